#include "agent/fkserve/relay/durability.h"

#include "absl/strings/match.h"

namespace fusekeeper::relay {

const char* DurabilityName(Durability d) {
  switch (d) {
    case Durability::kAtReply:
      return "write";
    case Durability::kAtSync:
      return "sync";
    case Durability::kAtClose:
      return "close";
    case Durability::kAtUnmount:
      return "unmount";
  }
  return "?";
}

std::optional<Durability> ParseDurability(absl::string_view name) {
  for (Durability d : {Durability::kAtReply, Durability::kAtSync, Durability::kAtClose, Durability::kAtUnmount}) {
    if (name == DurabilityName(d)) return d;
  }
  return std::nullopt;
}

std::optional<Durability> KnownDurability(absl::string_view program) {
  const size_t slash = program.rfind('/');
  if (slash != absl::string_view::npos) program.remove_prefix(slash + 1);
  // Write into their backing store (a local file system) before they answer.
  for (absl::string_view p : {"bindfs", "fuse-overlayfs", "unionfs-fuse", "unionfs", "gocryptfs", "encfs",
                              "securefs", "squashfuse", "squashfuse_ll", "nbdfuse"}) {
    if (program == p) return Durability::kAtReply;
  }
  // s3fs keeps written data in a local temp file and uploads at FLUSH/FSYNC; sshfs answers a
  // WRITE before the SFTP server has it and waits for every answer at FLUSH/FSYNC.
  if (program == "s3fs" || program == "sshfs") return Durability::kAtSync;
  // fuse2fs writes through libext2fs's block cache; the image is whole only once unmounted (an
  // fsync did not keep a kill from losing data in the model-checking writer's runs).
  if (program == "fuse-zip" || program == "archivemount" || program == "fuse2fs") return Durability::kAtUnmount;
  // Without a write cache rclone streams an open file to a partial object that exists only once
  // closed; with one it uploads after close (and a write-back delay): either way, after close.
  if (program == "rclone") return Durability::kAtClose;
  return std::nullopt;
}

}  // namespace fusekeeper::relay
