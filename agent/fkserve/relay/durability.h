// Durability: when a FUSE program makes a change it answered durable — what a relay that restarts
// the program must know to carry a change over a death, and no more.
//
// A program that stores every WRITE before it answers it (bindfs, fuse-overlayfs, gocryptfs...)
// loses nothing when it dies: writing its answered changes again would only undo what came
// after them. One that keeps data until FSYNC or FLUSH (s3fs uploads then; sshfs waits for its
// server's acknowledgements then) loses what it answered since, and the relay must write it
// again — in the order the kernel sent it relative to every other change of that file. One that
// keeps data until the file is closed and later (rclone's VFS cache uploads after close) or
// until unmount (fuse-zip, archivemount rewrite their archive then) loses it in a way no replay
// can repair: the app's next fsync or close of such a file is answered EIO instead.
#pragma once

#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace fusekeeper::relay {

enum class Durability {
  kAtReply,    // "write": stored before the answer; nothing to carry over a death
  kAtSync,     // "sync": stored at FSYNC/FLUSH of the handle; changes since are written again
  kAtClose,    // "close": stored (later) after close; a death loses open files' writes: EIO
  kAtUnmount,  // "unmount": stored at unmount; a death loses every write: EIO
};

// "write", "sync", "close", "unmount".
const char* DurabilityName(Durability d);
// The names above; nullopt for anything else.
std::optional<Durability> ParseDurability(absl::string_view name);
// What a known program does, by the base name of its executable (as launched: "bindfs",
// "/usr/bin/s3fs"); nullopt: unknown (the launcher then assumes kAtSync, which is right for
// every program that stores data no later than FSYNC/FLUSH).
std::optional<Durability> KnownDurability(absl::string_view program);

}  // namespace fusekeeper::relay
