// RelayCore against FakeInstance (an in-memory FUSE program) and a kernel played by the test:
// what a program restart must not change for the kernel (node ids, handles, requests in
// flight), what it cannot restore (and how that fails), bad input from the program, and a
// property test of random traffic with random kills.
#include "agent/fkserve/relay/relay_core.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <unistd.h>

#include <memory>
#include <random>

#include "absl/strings/str_join.h"
#include "agent/base/unique_fd.h"
#include "gtest/gtest.h"
#include "tests/fkserve/fake_program.h"

namespace fusekeeper::relay {
namespace {

using testing::Bytes;
using testing::Disk;
using testing::ErrorOf;
using testing::FakeInstance;
using testing::Wires;

constexpr size_t kMaxMessage = (1 << 20) + 4096;

class RelayCoreTest : public ::testing::Test {
 protected:
  RelayCoreTest() { NewCore(); }
  // A fresh relay (a new launcher on a new connection) writing a fresh journal.
  void NewCore() {
    core_.~RelayCore();
    new (&core_) RelayCore(&wires_, kMaxMessage, durability_);
    auto j = StateJournal::Create();
    EXPECT_TRUE(j.ok()) << j.status();
    journal_ = std::move(*j);
    core_.SetJournal(journal_.get());
  }
  // kill -9 of the launcher (and so of its program): a new launcher restores the relay from the
  // journal the agent kept, and the kernel sends again, with the resend bit, every request the
  // dead one had read and not answered (FUSE_NOTIFY_RESEND).
  void KillLauncher() {
    Kill();
    SavedState state;
    auto j = StateJournal::Open(UniqueFd(dup(journal_->fd())), &state);
    ASSERT_TRUE(j.ok()) << j.status();
    journal_ = std::move(*j);
    core_.~RelayCore();
    new (&core_) RelayCore(&wires_, kMaxMessage, durability_);
    core_.SetJournal(journal_.get());
    core_.Restore(state);
    ++launcher_deaths_;
    for (const auto& [u, m] : sent_) {
      if (!ReplyTo(u).empty()) continue;
      std::string again = m;
      Store<uint64_t>(again.data() + offsetof(fuse_in_header, unique), u | kResendUniqueBit);
      core_.FromKernel(again.data(), again.size());
    }
  }
  void Start() {
    prog_ = std::make_unique<FakeInstance>(&disk_, ++instances_ * 1000000);
    core_.ProgramStarted();
  }
  // kill -9: what was sent to it and not answered stays unanswered.
  void Kill() {
    if (prog_) {
      for (const std::string& v : prog_->violations) ADD_FAILURE() << "instance " << instances_ << ": " << v;
    }
    prog_.reset();
    wires_.to_program.clear();
    core_.ProgramGone();
  }
  // The program handles what it was sent, but dies before its replies get out.
  void DoWorkThenKill() {
    for (const std::string& m : wires_.to_program) prog_->Handle(m);
    wires_.to_program.clear();
    Kill();
  }
  // The program answers `unique`, the relay journals the answer, and dies before the kernel gets
  // it; a new launcher carries on and the kernel resends.
  void AnsweredThenLostWithTheLauncher(uint64_t unique) {
    Pump();
    ASSERT_EQ(ErrorOf(ReplyTo(unique)), 0);
    wires_.replies.erase(unique);  // the answer never got out
    KillLauncher();
    Start();
    Pump();
  }
  void Pump() {
    while (!wires_.to_program.empty()) {
      std::string m = wires_.to_program.front();
      wires_.to_program.erase(wires_.to_program.begin());
      if (!prog_) continue;
      std::string r = prog_->Handle(m);
      if (!r.empty()) core_.FromProgram(r.data(), r.size());
    }
  }
  uint64_t Send(uint32_t op, uint64_t nodeid, const std::string& body) {
    const uint64_t u = next_unique_;
    next_unique_ += 2;
    std::string m = testing::Request(op, u, nodeid, body);
    sent_[u] = m;
    core_.FromKernel(m.data(), m.size());
    return u;
  }
  // The reply to a request, whether or not it was sent again after a launcher died.
  std::string ReplyTo(uint64_t unique) {
    for (uint64_t u : {unique, unique | kResendUniqueBit}) {
      auto it = wires_.replies.find(u);
      if (it != wires_.replies.end()) return it->second;
    }
    return "";
  }
  std::string Call(uint32_t op, uint64_t nodeid, const std::string& body) {
    const uint64_t u = Send(op, nodeid, body);
    Pump();
    std::string r = ReplyTo(u);
    EXPECT_FALSE(r.empty()) << OpName(op) << " got no reply";
    return r;
  }
  fuse_init_out Init() {
    fuse_init_in in{};
    in.major = 7;
    in.minor = 38;
    in.flags = FUSE_MAX_PAGES | FUSE_SPLICE_READ | FUSE_SPLICE_WRITE | FUSE_INIT_EXT;
    const std::string r = Call(FUSE_INIT, 0, Bytes(in));
    return Load<fuse_init_out>(r.data() + sizeof(fuse_out_header));
  }
  uint64_t Lookup(uint64_t dir, const std::string& name) {
    const std::string r = Call(FUSE_LOOKUP, dir, name + std::string(1, '\0'));
    if (r.size() < sizeof(fuse_out_header) + sizeof(fuse_entry_out) || ErrorOf(r) != 0) return 0;
    return Load<fuse_entry_out>(r.data() + sizeof(fuse_out_header)).nodeid;
  }
  uint64_t Open(uint64_t node, uint32_t flags = O_RDWR) {
    fuse_open_in in{};
    in.flags = flags;
    const std::string r = Call(FUSE_OPEN, node, Bytes(in));
    EXPECT_EQ(ErrorOf(r), 0);
    return Load<fuse_open_out>(r.data() + sizeof(fuse_out_header)).fh;
  }
  std::string ReadBody(uint64_t node, uint64_t fh, uint64_t off, uint32_t size) {
    fuse_read_in in{};
    in.fh = fh;
    in.offset = off;
    in.size = size;
    return Bytes(in);
  }
  // A WRITE's body; a RENAME's, from one name to another in the root.
  static std::string WriteBody(uint64_t fh, uint64_t off, const std::string& data) {
    fuse_write_in in{};
    in.fh = fh;
    in.offset = off;
    in.size = static_cast<uint32_t>(data.size());
    return Bytes(in) + data;
  }
  static std::string RenameBody(const std::string& from, const std::string& to) {
    fuse_rename_in in{};
    in.newdir = FUSE_ROOT_ID;
    return Bytes(in) + from + '\0' + to + '\0';
  }
  std::string Read(uint64_t node, uint64_t fh) {
    const std::string r = Call(FUSE_READ, node, ReadBody(node, fh, 0, 4096));
    if (ErrorOf(r) != 0) return absl::StrCat("error ", ErrorOf(r));
    return r.substr(sizeof(fuse_out_header));
  }
  void TearDown() override {
    if (prog_) {
      for (const std::string& v : prog_->violations) ADD_FAILURE() << "instance " << instances_ << ": " << v;
    }
    EXPECT_TRUE(wires_.duplicate_replies.empty()) << "a request was answered twice";
    for (const auto& [u, r] : wires_.replies) {
      if (u & kResendUniqueBit) EXPECT_EQ(wires_.replies.count(u & ~kResendUniqueBit), 0u) << "answered twice: " << u;
    }
    EXPECT_EQ(core_.nodes().CheckInvariantsForTest(), "");
  }

  Durability durability_ = Durability::kAtSync;
  Disk disk_;
  Wires wires_;
  RelayCore core_{&wires_, kMaxMessage};
  std::unique_ptr<StateJournal> journal_;
  std::unique_ptr<FakeInstance> prog_;
  std::map<uint64_t, std::string> sent_;  // by unique: every request that wants a reply
  int instances_ = 0;
  int launcher_deaths_ = 0;
  uint64_t next_unique_ = 2;
};

TEST_F(RelayCoreTest, InitIsMaskedAndSizedAndIdsPassUnchangedInTheFirstInstance) {
  const uint64_t dir = disk_.Make(1, "d", true);
  disk_.Make(dir, "f", false, "hello");
  Start();
  const fuse_init_out init = Init();
  EXPECT_EQ(init.flags & (FUSE_SPLICE_READ | FUSE_SPLICE_WRITE | FUSE_SPLICE_MOVE), 0u) << "splice cannot be relayed";
  EXPECT_LE(init.max_write + sizeof(fuse_in_header) + sizeof(fuse_write_in), kMaxMessage);
  EXPECT_LE(init.max_pages * 4096u, kMaxMessage);
  // The request the program saw did not offer splice either.
  const uint64_t d = Lookup(FUSE_ROOT_ID, "d");
  EXPECT_EQ(d, prog_->base() + dir) << "the first instance's ids are the kernel's";
  const uint64_t f = Lookup(d, "f");
  const uint64_t fh = Open(f);
  EXPECT_EQ(Read(f, fh), "hello");
}

TEST_F(RelayCoreTest, ARestartedProgramResolvesNodesByPathAndReopensHandles) {
  const uint64_t a = disk_.Make(1, "a", true);
  const uint64_t b = disk_.Make(a, "b", true);
  disk_.Make(b, "file", false, "deep data");
  Start();
  Init();
  const uint64_t ka = Lookup(FUSE_ROOT_ID, "a");
  const uint64_t kb = Lookup(ka, "b");
  const uint64_t kf = Lookup(kb, "file");
  const uint64_t fh = Open(kf, O_RDONLY);
  fuse_open_in din{};
  const std::string dr = Call(FUSE_OPENDIR, kb, Bytes(din));
  ASSERT_EQ(ErrorOf(dr), 0);
  Kill();
  Start();
  Pump();  // the replayed INIT
  EXPECT_EQ(Read(kf, fh), "deep data") << "the kernel's node id and handle still work";
  EXPECT_EQ(ErrorOf(Call(FUSE_GETATTR, kb, Bytes(fuse_getattr_in{}))), 0);
  EXPECT_EQ(core_.stats().resolved, 3u) << "a, b and file looked up again, once each";
  EXPECT_EQ(core_.stats().reopened, 1u) << "only the file handle that was used";
  EXPECT_EQ(prog_->lookups(b), 1u) << "one reference held for the kernel's";
  // Releasing the directory handle the new instance never opened is answered by the relay.
  fuse_release_in rel{};
  rel.fh = Load<fuse_open_out>(dr.data() + sizeof(fuse_out_header)).fh;
  EXPECT_EQ(ErrorOf(Call(FUSE_RELEASEDIR, kb, Bytes(rel))), 0);
  rel.fh = fh;
  EXPECT_EQ(ErrorOf(Call(FUSE_RELEASE, kf, Bytes(rel))), 0);
  EXPECT_EQ(prog_->open_handles(), 0u);
  EXPECT_EQ(core_.handles(), 0u);
  // The kernel forgets everything: the new instance gets back exactly what it gave.
  for (uint64_t k : {kf, kb, ka}) {
    fuse_forget_in f{1};
    std::string m = testing::Request(FUSE_FORGET, next_unique_, k, Bytes(f));
    next_unique_ += 2;
    core_.FromKernel(m.data(), m.size());
    Pump();
  }
  EXPECT_EQ(prog_->lookups(a) + prog_->lookups(b), 0u);
  EXPECT_EQ(core_.nodes().size(), 1u) << "only the root is left";
}

TEST_F(RelayCoreTest, RequestsInFlightWhenTheProgramDiesAreAnsweredByTheNext) {
  disk_.Make(1, "f", false, "in flight");
  Start();
  Init();
  const uint64_t kf = Lookup(FUSE_ROOT_ID, "f");
  const uint64_t fh = Open(kf);
  const uint64_t u = Send(FUSE_READ, kf, ReadBody(kf, fh, 3, 100));
  ASSERT_EQ(wires_.to_program.size(), 1u);
  Kill();
  // More arrive while no program runs: they wait.
  const uint64_t later = Send(FUSE_GETATTR, kf, Bytes(fuse_getattr_in{}));
  EXPECT_TRUE(wires_.to_program.empty());
  EXPECT_EQ(ReplyTo(u), "");
  Start();
  Pump();
  ASSERT_NE(ReplyTo(u), "");
  EXPECT_EQ(ReplyTo(u).substr(sizeof(fuse_out_header)), "flight");
  EXPECT_EQ(ErrorOf(ReplyTo(later)), 0);
  EXPECT_EQ(core_.stats().resent, 1u);
}

TEST_F(RelayCoreTest, AProgramThatDiesBeforeAnsweringInitGetsItsInitResent) {
  Start();
  fuse_init_in in{};
  in.major = 7;
  in.minor = 38;
  const uint64_t u = Send(FUSE_INIT, 0, Bytes(in));
  Kill();
  Start();
  Pump();
  ASSERT_NE(ReplyTo(u), "");
  EXPECT_EQ(ErrorOf(ReplyTo(u)), 0);
  EXPECT_TRUE(core_.initialized());
}

TEST_F(RelayCoreTest, AnOpenFileThatWasUnlinkedFailsWithEstaleAfterARestart) {
  disk_.Make(1, "gone", false, "x");
  disk_.Make(1, "kept", false, "y");
  Start();
  Init();
  const uint64_t kg = Lookup(FUSE_ROOT_ID, "gone");
  const uint64_t kk = Lookup(FUSE_ROOT_ID, "kept");
  const uint64_t fg = Open(kg), fk = Open(kk);
  ASSERT_EQ(ErrorOf(Call(FUSE_UNLINK, FUSE_ROOT_ID, std::string("gone") + '\0')), 0);
  // Said when it happens, while the file still works: the one held file that lost its path.
  const std::string said = absl::StrJoin(wires_.logs, "\n");
  EXPECT_NE(said.find(absl::StrCat("node ", kg, ", open, lost its path 'gone' at the program's UNLINK reply")),
            std::string::npos)
      << said;
  EXPECT_EQ(said.find("'kept'"), std::string::npos) << said;
  Kill();
  Start();
  Pump();
  EXPECT_EQ(Read(kg, fg), absl::StrCat("error ", -ESTALE));
  EXPECT_EQ(Read(kk, fk), "y") << "one lost file fails alone";
  EXPECT_EQ(core_.stats().restore_failures, 1u);
}

TEST_F(RelayCoreTest, APathRenamedBeforeTheRestartResolvesUnderItsNewName) {
  const uint64_t d = disk_.Make(1, "old", true);
  disk_.Make(d, "f", false, "moved");
  Start();
  Init();
  const uint64_t kd = Lookup(FUSE_ROOT_ID, "old");
  const uint64_t kf = Lookup(kd, "f");
  ASSERT_EQ(ErrorOf(Call(FUSE_RENAME, FUSE_ROOT_ID, RenameBody("old", "new"))), 0);
  Kill();
  Start();
  Pump();
  const uint64_t fh = Open(kf, O_RDONLY);
  EXPECT_EQ(Read(kf, fh), "moved");
}

TEST_F(RelayCoreTest, WorkTheDeadProgramDidIsNotDoneTwice) {
  disk_.Make(1, "victim", false, "x");
  const uint64_t src = disk_.Make(1, "src", false, "s");
  (void)src;
  Start();
  Init();
  // UNLINK done, reply lost: the relay sees the name gone and answers 0 (a resend would say ENOENT).
  const uint64_t unlink = Send(FUSE_UNLINK, FUSE_ROOT_ID, std::string("victim") + '\0');
  // MKDIR done, reply lost: the relay answers with the directory that now exists (not EEXIST).
  fuse_mkdir_in mk{};
  mk.mode = 0755;
  const uint64_t mkdir = Send(FUSE_MKDIR, FUSE_ROOT_ID, Bytes(mk) + "made" + '\0');
  // RENAME done, reply lost.
  const uint64_t rename = Send(FUSE_RENAME, FUSE_ROOT_ID, RenameBody("src", "dst"));
  DoWorkThenKill();
  Start();
  Pump();
  EXPECT_EQ(ErrorOf(ReplyTo(unlink)), 0);
  ASSERT_EQ(ErrorOf(ReplyTo(mkdir)), 0);
  const uint64_t kmade = Load<fuse_entry_out>(ReplyTo(mkdir).data() + sizeof(fuse_out_header)).nodeid;
  EXPECT_NE(kmade, 0u);
  EXPECT_EQ(ErrorOf(Call(FUSE_GETATTR, kmade, Bytes(fuse_getattr_in{}))), 0);
  EXPECT_EQ(ErrorOf(ReplyTo(rename)), 0);
  EXPECT_EQ(core_.stats().done_by_dead, 3u);
  EXPECT_EQ(Lookup(FUSE_ROOT_ID, "dst") != 0, true);
}

// A RENAME the program did just before it died (its answer lost), and a request on the renamed
// file queued behind it: the file must not be looked up by its old name before the RENAME is
// decided (the old name is gone, and the file would be lost for good: ESTALE on every open
// handle). Seen with s3fs under load: a launcher killed mid-rename left a held file stale.
TEST_F(RelayCoreTest, ARenameTheDeadProgramDidIsDecidedBeforeTheFileIsLookedUpAgain) {
  disk_.Make(1, "a", false, "renamed");
  Start();
  Init();
  const uint64_t ka = Lookup(FUSE_ROOT_ID, "a");
  const uint64_t fh = Open(ka, O_RDONLY);
  const uint64_t rename = Send(FUSE_RENAME, FUSE_ROOT_ID, RenameBody("a", "b"));
  DoWorkThenKill();  // renamed on the disk; the answer never got out
  const uint64_t getattr = Send(FUSE_GETATTR, ka, Bytes(fuse_getattr_in{}));
  Start();
  Pump();
  ASSERT_FALSE(ReplyTo(rename).empty());
  EXPECT_EQ(ErrorOf(ReplyTo(rename)), 0) << "done by the dead instance";
  ASSERT_FALSE(ReplyTo(getattr).empty());
  EXPECT_EQ(ErrorOf(ReplyTo(getattr)), 0) << "the file is found under its new name";
  EXPECT_EQ(Read(ka, fh), "renamed");
  EXPECT_EQ(core_.stats().restore_failures, 0u) << absl::StrJoin(wires_.logs, "\n");
}

// The same with changes the program kept unsynced: they are written again into the file under
// its new name, once the RENAME is decided (before, the replay looked it up by its old name, gave
// up on it, and every held handle got ESTALE; seen with sshfs when the launcher was killed).
TEST_F(RelayCoreTest, KeptChangesOfAFileTheDeadProgramRenamedAreWrittenUnderItsNewName) {
  const uint64_t ino = disk_.Make(1, "a", false, "");
  Start();
  prog_->keeps_writes_until_sync = true;
  Init();
  const uint64_t ka = Lookup(FUSE_ROOT_ID, "a");
  const uint64_t fh = Open(ka, O_RDWR);
  ASSERT_EQ(ErrorOf(Call(FUSE_WRITE, ka, WriteBody(fh, 0, "kept"))), 0);
  const uint64_t rename = Send(FUSE_RENAME, FUSE_ROOT_ID, RenameBody("a", "b"));
  DoWorkThenKill();  // renamed (its data still only in the dead instance); the answer never got out
  Start();
  prog_->keeps_writes_until_sync = true;
  Pump();
  EXPECT_EQ(ErrorOf(ReplyTo(rename)), 0);
  EXPECT_EQ(disk_.inodes[ino].data, "kept") << "written again and flushed under its new name";
  EXPECT_EQ(Read(ka, fh), "kept");
  EXPECT_EQ(core_.stats().files_lost, 0u) << absl::StrJoin(wires_.logs, "\n");
}

// A program that makes a created file only at its first sync (s3fs: the object is PUT at FLUSH)
// dies before that: the new instance lacks the file, so the relay makes it again where it is now
// (it was renamed meanwhile) and writes its kept changes into it; the held handle goes on.
TEST_F(RelayCoreTest, AFileTheDeadProgramHadNotMadeYetIsMadeAgainWithItsChanges) {
  Start();
  prog_->keeps_writes_until_sync = prog_->keeps_creates_until_sync = true;
  Init();
  fuse_create_in in{};
  in.flags = O_RDWR | O_CREAT;
  in.mode = 0100644;
  const std::string r = Call(FUSE_CREATE, FUSE_ROOT_ID, Bytes(in) + std::string("new\0", 4));
  ASSERT_EQ(ErrorOf(r), 0);
  const uint64_t kn = Load<fuse_entry_out>(r.data() + sizeof(fuse_out_header)).nodeid;
  const uint64_t fh = Load<fuse_open_out>(r.data() + sizeof(fuse_out_header) + sizeof(fuse_entry_out)).fh;
  ASSERT_EQ(ErrorOf(Call(FUSE_WRITE, kn, WriteBody(fh, 0, "data"))), 0);
  ASSERT_EQ(ErrorOf(Call(FUSE_RENAME, FUSE_ROOT_ID, RenameBody("new", "moved"))), 0);
  EXPECT_EQ(disk_.inodes[1].children.count("moved"), 0u) << "only the instance knows it";
  Kill();
  Start();
  prog_->keeps_writes_until_sync = prog_->keeps_creates_until_sync = true;
  Pump();
  ASSERT_EQ(disk_.inodes[1].children.count("moved"), 1u) << absl::StrJoin(wires_.logs, "\n");
  EXPECT_EQ(disk_.inodes[disk_.inodes[1].children["moved"]].data, "data");
  EXPECT_EQ(Read(kn, fh), "data");
  EXPECT_EQ(core_.stats().files_lost, 0u) << absl::StrJoin(wires_.logs, "\n");
  EXPECT_EQ(core_.stats().restore_failures, 0u) << absl::StrJoin(wires_.logs, "\n");
}

// A program that keeps written data until it syncs (s3fs) dies after answering WRITEs: the
// relay writes them again into the file (through a handle of its own, then a FLUSH) before the
// new instance sees any request, so nothing the app was told was written is lost.
TEST_F(RelayCoreTest, WritesTheDeadProgramHadNotSyncedAreWrittenAgain) {
  const uint64_t ino = disk_.Make(1, "f", false, "");
  Start();
  prog_->keeps_writes_until_sync = true;
  Init();
  const uint64_t kf = Lookup(FUSE_ROOT_ID, "f");
  const uint64_t fh = Open(kf, O_WRONLY | O_APPEND);
  auto write = [&](uint64_t off, const std::string& data) { return ErrorOf(Call(FUSE_WRITE, kf, WriteBody(fh, off, data))); };
  ASSERT_EQ(write(0, "synced "), 0);
  fuse_fsync_in sync{};
  sync.fh = fh;
  ASSERT_EQ(ErrorOf(Call(FUSE_FSYNC, kf, Bytes(sync))), 0);
  ASSERT_EQ(write(7, "then accepted"), 0);
  EXPECT_EQ(disk_.inodes[ino].data, "synced ") << "the program holds the rest";
  Kill();
  Start();
  prog_->keeps_writes_until_sync = true;
  Pump();
  EXPECT_EQ(ErrorOf(Call(FUSE_FSYNC, kf, Bytes(sync))), 0);
  EXPECT_EQ(disk_.inodes[ino].data, "synced then accepted") << "written again at its offset, once";
  EXPECT_EQ(core_.stats().writes_replayed, 1u) << "only what was not synced";
}

// The launcher itself killed (its container restarted, its image upgraded) with a file open, a
// write it accepted but the program had not synced, and a read in flight: the next launcher
// restores the relay from the journal; the kernel's ids and handles keep working, the read that
// was in flight is answered once, and the unsynced write reaches the disk at the next fsync.
// The core journals a RENAME's effect before it writes the answer to the kernel: a launcher (or
// a program running the core) killed between the two leaves a journal that has the file renamed
// and a kernel that sends the RENAME again. The next core finds the old name gone ("done by the
// dead instance") and must not take the file under its new name for another one the RENAME
// replaced: it lost its path, and every later restart failed the held file with ESTALE (seen:
// unionfs-fuse under the model-checking writer, in full-suite runs).
TEST_F(RelayCoreTest, ARenameJournaledButNeverAnsweredIsNotAppliedTwice) {
  disk_.Make(1, "a", false, "renamed");
  Start();
  Init();
  const uint64_t ka = Lookup(FUSE_ROOT_ID, "a");
  const uint64_t fh = Open(ka, O_RDONLY);
  const uint64_t rename = Call(FUSE_RENAME, FUSE_ROOT_ID, RenameBody("a", "b")).empty() ? 0 : next_unique_ - 2;
  ASSERT_NE(rename, 0u);
  wires_.replies.erase(rename);  // the answer never got out
  KillLauncher();
  Start();
  Pump();
  ASSERT_FALSE(ReplyTo(rename).empty());
  EXPECT_EQ(ErrorOf(ReplyTo(rename)), 0) << "done by the dead instance";
  EXPECT_EQ(Read(ka, fh), "renamed");
  // And after the next restart, the file is still found by its path.
  Kill();
  Start();
  Pump();
  EXPECT_EQ(Read(ka, fh), "renamed");
  EXPECT_EQ(core_.stats().restore_failures, 0u) << absl::StrJoin(wires_.logs, "\n");
  EXPECT_EQ(absl::StrJoin(wires_.logs, "\n").find("lost its path"), std::string::npos) << absl::StrJoin(wires_.logs, "\n");
}

// A RENAME_EXCHANGE the dead launcher's program did and whose answer it journaled, but the
// kernel never got: resent, it must not be done again (the names would swap back).
TEST_F(RelayCoreTest, AnExchangeJournaledButNeverAnsweredIsNotSwappedBack) {
  disk_.Make(1, "a", false, "was a");
  disk_.Make(1, "b", false, "was b");
  Start();
  Init();
  Lookup(FUSE_ROOT_ID, "a");
  Lookup(FUSE_ROOT_ID, "b");
  fuse_rename2_in in{};
  in.newdir = FUSE_ROOT_ID;
  in.flags = RENAME_EXCHANGE;
  const uint64_t exchange = Send(FUSE_RENAME2, FUSE_ROOT_ID, Bytes(in) + std::string("a\0b\0", 4));
  AnsweredThenLostWithTheLauncher(exchange);
  ASSERT_FALSE(ReplyTo(exchange).empty());
  EXPECT_EQ(ErrorOf(ReplyTo(exchange)), 0);
  const uint64_t ka = Lookup(FUSE_ROOT_ID, "a");
  EXPECT_EQ(Read(ka, Open(ka, O_RDONLY)), "was b") << "swapped once, as the pod was told";
  EXPECT_EQ(core_.stats().restore_failures, 0u) << absl::StrJoin(wires_.logs, "\n");
}

// A CREATE whose answer the dead launcher journaled and the kernel never got: the resend gets
// that answer (the same file, and a handle that works), not EIO.
TEST_F(RelayCoreTest, ACreateJournaledButNeverAnsweredIsAnsweredWithItsFile) {
  Start();
  Init();
  fuse_create_in in{};
  in.flags = O_RDWR | O_CREAT | O_EXCL;
  in.mode = 0644;
  const uint64_t create = Send(FUSE_CREATE, FUSE_ROOT_ID, Bytes(in) + std::string("new\0", 4));
  AnsweredThenLostWithTheLauncher(create);
  const std::string r = ReplyTo(create);
  ASSERT_EQ(ErrorOf(r), 0) << absl::StrJoin(wires_.logs, "\n");
  ASSERT_GE(r.size(), sizeof(fuse_out_header) + sizeof(fuse_entry_out) + sizeof(fuse_open_out));
  const auto entry = Load<fuse_entry_out>(r.data() + sizeof(fuse_out_header));
  const auto open = Load<fuse_open_out>(r.data() + sizeof(fuse_out_header) + sizeof(fuse_entry_out));
  EXPECT_EQ(Lookup(FUSE_ROOT_ID, "new"), entry.nodeid) << "the file the pod was told it made";
  ASSERT_EQ(ErrorOf(Call(FUSE_WRITE, entry.nodeid, WriteBody(open.fh, 0, "through it"))), 0);
  EXPECT_EQ(Read(entry.nodeid, open.fh), "through it");
  EXPECT_EQ(core_.stats().restore_failures, 0u) << absl::StrJoin(wires_.logs, "\n");
}

TEST_F(RelayCoreTest, ANewLauncherCarriesOnFromTheJournal) {
  const uint64_t dir = disk_.Make(1, "d", true);
  const uint64_t ino = disk_.Make(dir, "f", false, "");
  disk_.Make(dir, "g", false, "read me");
  Start();
  prog_->keeps_writes_until_sync = true;
  Init();
  const uint64_t kd = Lookup(FUSE_ROOT_ID, "d");
  const uint64_t kf = Lookup(kd, "f");
  const uint64_t kg = Lookup(kd, "g");
  const uint64_t fh = Open(kf, O_WRONLY);
  const uint64_t gh = Open(kg, O_RDONLY);
  ASSERT_EQ(ErrorOf(Call(FUSE_WRITE, kf, WriteBody(fh, 0, "accepted"))), 0);
  const uint64_t read = Send(FUSE_READ, kg, ReadBody(kg, gh, 0, 4096));  // read by the launcher, then it dies
  KillLauncher();
  EXPECT_TRUE(ReplyTo(read).empty()) << "nothing answers before a program serves";
  Start();
  prog_->keeps_writes_until_sync = true;
  Pump();
  ASSERT_FALSE(ReplyTo(read).empty()) << "the resent read is answered";
  EXPECT_EQ(ReplyTo(read).substr(sizeof(fuse_out_header)), "read me");
  EXPECT_EQ(Lookup(kd, "g"), kg) << "the same file keeps its kernel id";
  fuse_fsync_in sync{};
  sync.fh = fh;
  EXPECT_EQ(ErrorOf(Call(FUSE_FSYNC, kf, Bytes(sync))), 0);
  EXPECT_EQ(disk_.inodes[ino].data, "accepted") << "the write only the dead launcher's memory held";
  EXPECT_EQ(Read(kg, gh), "read me");
  EXPECT_EQ(core_.stats().restore_failures, 0u);
}

// A handle released just before the launcher dies is not restored (its release is journaled with
// the answer, not at the next one): seen on a real kubelet, each sidecar restart carried one more
// stale handle.
TEST_F(RelayCoreTest, AHandleReleasedJustBeforeTheLauncherDiesIsNotRestored) {
  disk_.Make(1, "f", false, "x");
  Start();
  Init();
  const uint64_t kf = Lookup(FUSE_ROOT_ID, "f");
  const uint64_t fh = Open(kf, O_RDONLY);
  fuse_release_in rel{};
  rel.fh = fh;
  ASSERT_EQ(ErrorOf(Call(FUSE_RELEASE, kf, Bytes(rel))), 0);
  KillLauncher();
  EXPECT_EQ(core_.handles(), 0u);
}

// A MKDIR the dead launcher had passed to a program that did it, but whose answer never reached
// the kernel: sent again by the kernel, it is looked at first and answered with the directory
// the dead program made (not EEXIST, which the app would see as an error).
TEST_F(RelayCoreTest, WorkDoneBeforeTheLauncherDiedIsNotDoneTwice) {
  Start();
  Init();
  fuse_mkdir_in mk{};
  mk.mode = 0755;
  const uint64_t u = Send(FUSE_MKDIR, FUSE_ROOT_ID, Bytes(mk) + "new" + std::string(1, '\0'));
  for (const std::string& m : wires_.to_program) prog_->Handle(m);  // done; the reply is lost
  wires_.to_program.clear();
  KillLauncher();
  Start();
  Pump();
  ASSERT_FALSE(ReplyTo(u).empty());
  EXPECT_EQ(ErrorOf(ReplyTo(u)), 0) << "answered with the entry the dead program made";
  EXPECT_EQ(core_.stats().done_by_dead, 1u);
}

// The journal stays bounded: it is compacted as it grows, and what it restores is the state.
TEST_F(RelayCoreTest, TheJournalIsCompactedAndStillRestoresTheState) {
  for (int i = 0; i < 200; ++i) disk_.Make(1, absl::StrCat("file-with-a-longish-name-", i), false, "x");
  Start();
  Init();
  uint64_t first = 0;
  for (int round = 0; round < 200; ++round) {
    for (int i = 0; i < 200; ++i) {
      const uint64_t k = Lookup(FUSE_ROOT_ID, absl::StrCat("file-with-a-longish-name-", i));
      if (round == 0 && i == 0) first = k;
      if (i > 0) {
        fuse_forget_in f{1};
        std::string m = testing::Request(FUSE_FORGET, next_unique_, k, Bytes(f));
        next_unique_ += 2;
        core_.FromKernel(m.data(), m.size());
      }
    }
  }
  EXPECT_LT(journal_->log_bytes(), 4u << 20) << "40000 lookups and forgets, compacted";
  const SavedState before = core_.SaveForTest();
  KillLauncher();
  const SavedState after = core_.SaveForTest();
  EXPECT_EQ(after.nodes.size(), before.nodes.size());
  ASSERT_EQ(after.nodes.count(first), 1u);
  EXPECT_EQ(after.nodes.at(first).kernel_lookups, 200u);
  Start();
  EXPECT_EQ(Lookup(FUSE_ROOT_ID, "file-with-a-longish-name-0"), first);
}

// A listing in progress across a restart: the reopened directory handle is read once from
// offset 0 before the kernel's READDIR at its offset is sent (libfuse's high-level API lists a
// directory once per handle; sshfs asserted on a fresh handle asked for another offset).
TEST_F(RelayCoreTest, AListingInProgressResumesOnTheReopenedHandle) {
  for (int i = 0; i < 5; ++i) disk_.Make(1, absl::StrCat("e", i), false);
  Start();
  Init();
  const std::string opened = Call(FUSE_OPENDIR, FUSE_ROOT_ID, Bytes(fuse_open_in{}));
  const uint64_t dh = Load<fuse_open_out>(opened.data() + sizeof(fuse_out_header)).fh;
  fuse_read_in in{};
  in.fh = dh;
  in.size = 4096;
  ASSERT_EQ(ErrorOf(Call(FUSE_READDIR, FUSE_ROOT_ID, Bytes(in))), 0);
  Kill();
  Start();
  Pump();
  in.offset = 2;  // where the app's listing had got to
  const std::string rest = Call(FUSE_READDIR, FUSE_ROOT_ID, Bytes(in));
  ASSERT_EQ(ErrorOf(rest), 0);
  const auto first = Load<fuse_dirent>(rest.data() + sizeof(fuse_out_header));
  EXPECT_EQ(first.off, 3u) << "the listing goes on after the second entry";
}

// Two listings resumed at once, one READDIRPLUS and one READDIR: each primer's reply is read as
// what it is, and the lookups the READDIRPLUS primer took (entries the kernel never sees) are
// given back to the program.
TEST_F(RelayCoreTest, PrimersOfBothKindsAtOnceGiveBackExactlyTheirLookups) {
  const uint64_t a = disk_.Make(1, "a", true), b = disk_.Make(1, "b", true);
  const uint64_t a0 = disk_.Make(a, "a0", false);
  disk_.Make(a, "a1", false);
  disk_.Make(a, "a2", false);
  for (int i = 0; i < 3; ++i) disk_.Make(b, absl::StrCat("b", i), false);
  Start();
  Init();
  const uint64_t ka = Lookup(FUSE_ROOT_ID, "a"), kb = Lookup(FUSE_ROOT_ID, "b");
  auto opendir = [&](uint64_t k) {
    return Load<fuse_open_out>(Call(FUSE_OPENDIR, k, Bytes(fuse_open_in{})).data() + sizeof(fuse_out_header)).fh;
  };
  const uint64_t ha = opendir(ka), hb = opendir(kb);
  Kill();
  Start();
  Pump();
  fuse_read_in in{};
  in.size = 4096;
  in.offset = 2;
  in.fh = ha;
  const uint64_t plus = Send(FUSE_READDIRPLUS, ka, Bytes(in));
  in.fh = hb;
  const uint64_t plain = Send(FUSE_READDIR, kb, Bytes(in));
  Pump();
  ASSERT_EQ(ErrorOf(ReplyTo(plus)), 0);
  ASSERT_EQ(ErrorOf(ReplyTo(plain)), 0);
  EXPECT_EQ(prog_->lookups(a0), 0u) << "a0 was listed only by the primer: its lookup is given back";
  EXPECT_EQ(core_.nodes().CheckInvariantsForTest(), "");
}

// A request that kills every instance it reaches is sent to at most 3, then answered EIO: a
// poison request cannot keep the volume down.
TEST_F(RelayCoreTest, ARequestThatKillsEveryInstanceFailsAfterThree) {
  disk_.Make(1, "f", false, "x");
  Start();
  Init();
  const uint64_t kf = Lookup(FUSE_ROOT_ID, "f");
  const uint64_t poison = Send(FUSE_GETATTR, kf, Bytes(fuse_getattr_in{}));
  // Each instance answers everything until it reads the poison, and dies there.
  auto serve_until_poison = [&] {
    while (!wires_.to_program.empty()) {
      std::string m = wires_.to_program.front();
      wires_.to_program.erase(wires_.to_program.begin());
      if (InHeader(m.data()).unique == poison) return true;
      std::string r = prog_->Handle(m);
      if (!r.empty()) core_.FromProgram(r.data(), r.size());
    }
    return false;
  };
  int seen = 0;
  while (serve_until_poison() && seen < 5) {
    ++seen;
    Kill();
    Start();
  }
  ASSERT_FALSE(ReplyTo(poison).empty());
  EXPECT_EQ(ErrorOf(ReplyTo(poison)), -EIO);
  EXPECT_EQ(seen, 3) << "sent to three instances, not a fourth";
  EXPECT_EQ(ErrorOf(Call(FUSE_GETATTR, kf, Bytes(fuse_getattr_in{}))), 0) << "the volume goes on";
}

TEST_F(RelayCoreTest, BadRepliesFailOnlyTheirRequestAndNeverTheConnection) {
  disk_.Make(1, "f", false, "data");
  Start();
  Init();
  const uint64_t kf = Lookup(FUSE_ROOT_ID, "f");
  auto inject = [&](std::string m) { core_.FromProgram(m.data(), m.size()); };
  // A reply to a unique nobody asked: dropped.
  inject(testing::Reply(999998, 0, ""));
  // Shorter than a header: dropped.
  inject("abc");
  // Length field lying: its request gets EIO.
  uint64_t u = Send(FUSE_GETATTR, kf, Bytes(fuse_getattr_in{}));
  wires_.to_program.clear();
  std::string lie = testing::Reply(u, 0, Bytes(fuse_attr_out{}));
  Store<uint32_t>(lie.data(), 4);
  inject(lie);
  EXPECT_EQ(ErrorOf(ReplyTo(u)), -EIO);
  // An entry reply too short for its entry: EIO.
  u = Send(FUSE_LOOKUP, FUSE_ROOT_ID, std::string("f") + '\0');
  wires_.to_program.clear();
  inject(testing::Reply(u, 0, "short"));
  EXPECT_EQ(ErrorOf(ReplyTo(u)), -EIO);
  // A positive error: EIO.
  u = Send(FUSE_GETATTR, kf, Bytes(fuse_getattr_in{}));
  wires_.to_program.clear();
  inject(testing::Reply(u, 5, ""));
  EXPECT_EQ(ErrorOf(ReplyTo(u)), -EIO);
  // The same unique answered twice: the second is dropped.
  inject(testing::Reply(u, 0, ""));
  // A notification naming a node the kernel does not know: dropped, not passed on.
  fuse_notify_inval_inode_out inval{};
  inval.ino = 123456789;
  inject(testing::Reply(0, FUSE_NOTIFY_INVAL_INODE, Bytes(inval)));
  EXPECT_TRUE(wires_.notifications.empty());
  // One naming a known node is passed on with the kernel's id.
  inval.ino = prog_->base() + 2;
  inject(testing::Reply(0, FUSE_NOTIFY_INVAL_INODE, Bytes(inval)));
  ASSERT_EQ(wires_.notifications.size(), 1u);
  EXPECT_EQ(Load<fuse_notify_inval_inode_out>(wires_.notifications[0].data() + sizeof(fuse_out_header)).ino, kf);
  // A truncated (oversized) reply: EIO.
  u = Send(FUSE_GETATTR, kf, Bytes(fuse_getattr_in{}));
  wires_.to_program.clear();
  std::string big = testing::Reply(u, 0, "x");
  core_.FromProgram(big.data(), big.size(), /*truncated=*/true);
  EXPECT_EQ(ErrorOf(ReplyTo(u)), -EIO);
  EXPECT_GE(core_.stats().bad_messages, 7u);
  // And the relay still works.
  EXPECT_EQ(Read(kf, Open(kf)), "data");
}

// Random traffic from a kernel that plays by the rules, against instances killed at random
// moments (with work done and replies lost, or not): every request is answered exactly once,
// never with an error while the file it names still exists under its path, every instance sees
// only ids it issued and is never over-forgotten, and the table's invariants hold throughout.
TEST_F(RelayCoreTest, PropertyRandomTrafficAndKills) {
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    std::mt19937 rng(seed);
    disk_ = Disk();
    for (int i = 0; i < 4; ++i) {
      const uint64_t d = disk_.Make(1, absl::StrCat("d", i), true);
      for (int j = 0; j < 4; ++j) disk_.Make(d, absl::StrCat("f", j), false, absl::StrCat("content ", i, j));
    }
    wires_ = Wires();
    sent_.clear();
    NewCore();
    instances_ = 0;
    Start();
    Init();
    struct Known {
      uint64_t kid;
      std::string content;
      uint64_t lookups;
    };
    std::map<std::string, Known> known;  // "i/j" → the kernel's node for d<i>/f<j>
    std::map<uint64_t, uint64_t> dirs;   // i → kid, with its lookup count
    std::map<uint64_t, uint64_t> dir_lookups;
    struct Open {
      uint64_t fh, kid;
      std::string content;
    };
    std::vector<Open> open;
    std::map<uint64_t, std::string> expect_read;  // unique → content
    std::map<uint64_t, uint64_t> read_fh;         // unique → fh
    // The kernel releases a handle only when no read on it is pending, and keeps a node while a
    // file is open on it.
    auto busy = [&](uint64_t fh) {
      for (const auto& [u, f] : read_fh) {
        if (f == fh && ReplyTo(u).empty()) return true;
      }
      return false;
    };
    auto opened = [&](uint64_t kid) {
      for (const Open& o : open) {
        if (o.kid == kid) return true;
      }
      return false;
    };
    for (int step = 0; step < 300; ++step) {
      const int i = static_cast<int>(rng() % 4), j = static_cast<int>(rng() % 4);
      const std::string key = absl::StrCat(i, "/", j);
      switch (rng() % 8) {
        case 0:
        case 1: {  // look up a file (and its directory)
          if (!dirs.count(i)) {
            const uint64_t kd = Lookup(FUSE_ROOT_ID, absl::StrCat("d", i));
            if (kd == 0) break;  // a reply still waits for a program: fine, try later
            dirs[i] = kd;
            ++dir_lookups[i];
          }
          const uint64_t kf = Lookup(dirs[i], absl::StrCat("f", j));
          if (kf == 0) break;
          auto& k = known[key];
          if (k.kid != 0) EXPECT_EQ(k.kid, kf) << "the same file keeps its kernel id";
          k.kid = kf;
          k.content = absl::StrCat("content ", i, j);
          ++k.lookups;
          break;
        }
        case 2: {  // open and read, maybe leaving the read in flight
          if (!known.count(key)) break;
          const std::string r = Call(FUSE_OPEN, known[key].kid, Bytes(fuse_open_in{}));
          if (r.empty()) break;
          ASSERT_EQ(ErrorOf(r), 0);
          const uint64_t fh = Load<fuse_open_out>(r.data() + sizeof(fuse_out_header)).fh;
          open.push_back({fh, known[key].kid, known[key].content});
          const uint64_t u = Send(FUSE_READ, known[key].kid, ReadBody(0, fh, 0, 4096));
          expect_read[u] = known[key].content;
          read_fh[u] = fh;
          if (rng() % 2) Pump();
          break;
        }
        case 3: {  // read an open handle
          if (open.empty()) break;
          const Open& o = open[rng() % open.size()];
          const uint64_t u = Send(FUSE_READ, o.kid, ReadBody(0, o.fh, 0, 4096));
          expect_read[u] = o.content;
          read_fh[u] = o.fh;
          break;
        }
        case 4: {  // forget some
          if (!known.count(key) || known[key].lookups == 0) break;
          uint64_t n = 1 + rng() % known[key].lookups;
          if (n == known[key].lookups && opened(known[key].kid)) --n;
          if (n == 0) break;
          fuse_forget_in f{n};
          std::string m = testing::Request(FUSE_FORGET, next_unique_, known[key].kid, Bytes(f));
          next_unique_ += 2;
          core_.FromKernel(m.data(), m.size());
          if ((known[key].lookups -= n) == 0) known.erase(key);
          break;
        }
        case 5: {  // release
          if (open.empty()) break;
          const size_t at = rng() % open.size();
          if (busy(open[at].fh)) break;
          fuse_release_in rel{};
          rel.fh = open[at].fh;
          Send(FUSE_RELEASE, open[at].kid, Bytes(rel));
          open.erase(open.begin() + static_cast<long>(at));
          break;
        }
        case 6:
          Pump();
          break;
        case 7:  // kill, maybe after it did work it could not answer; maybe the launcher too
          if (rng() % 4 != 0) break;
          if (rng() % 2) {
            for (const std::string& m : wires_.to_program) prog_->Handle(m);
            wires_.to_program.clear();
          }
          if (rng() % 3 == 0) {
            KillLauncher();
          } else {
            Kill();
          }
          Start();
          break;
      }
      ASSERT_EQ(core_.nodes().CheckInvariantsForTest(), "") << "step " << step;
    }
    Pump();
    for (const auto& [u, content] : expect_read) {
      const std::string r = ReplyTo(u);
      ASSERT_FALSE(r.empty()) << "read " << u << " never answered";
      EXPECT_EQ(ErrorOf(r), 0) << "read " << u;
      EXPECT_EQ(r.substr(sizeof(fuse_out_header)), content);
    }
    EXPECT_EQ(core_.requests_in_flight(), 0u);
    for (const std::string& v : prog_->violations) ADD_FAILURE() << v;
    prog_->violations.clear();
    EXPECT_TRUE(wires_.duplicate_replies.empty());
    // A file is never stale while it was not touched by anything but reads.
    EXPECT_EQ(core_.stats().restore_failures, 0u);
  }
  EXPECT_GT(launcher_deaths_, 10) << "the launcher died often enough to matter";
}

// The relay's replay against a reference model of each file: random WRITEs, truncates (through a
// handle, by path, by an open with O_TRUNC), FSYNCs, FLUSHes, closes and reads through several
// handles of a few files, with the program killed (some work done but unanswered, some requests
// in flight) and the launcher killed at random points, for programs that store a change before
// they answer it, at a sync of the file (s3fs), or at a sync of the handle it came through
// (sshfs, the worst case: what reaches the disk is any subset of the changes). Every read must
// return the model's bytes, no fsync or close may fail (nothing is beyond the relay's bounds), and
// afterwards each file, read again and once everything is synced and the program restarted, holds
// the model's bytes. Before the ChangeLog, a handle's WRITEs written again after a later truncate
// or a later WRITE through another handle gave files bytes they never had.
TEST_F(RelayCoreTest, PropertyReplayedChangesMatchAFileModel) {
  struct Program {
    const char* what;
    Durability relay;
    bool per_node, per_handle;
  };
  for (const Program& program : {Program{"stores at reply, relay told so", Durability::kAtReply, false, false},
                                 Program{"stores at reply, relay assumes sync", Durability::kAtSync, false, false},
                                 Program{"stores at a sync of the file", Durability::kAtSync, true, false},
                                 Program{"stores at a sync of the handle", Durability::kAtSync, false, true}}) {
    for (uint32_t seed = 1; seed <= 30; ++seed) {
      SCOPED_TRACE(absl::StrCat(program.what, ", seed ", seed));
      std::mt19937 rng(seed);
      durability_ = program.relay;
      disk_ = Disk();
      constexpr int kFiles = 3;
      std::vector<uint64_t> inos;
      for (int i = 0; i < kFiles; ++i) inos.push_back(disk_.Make(1, absl::StrCat("f", i), false, ""));
      wires_ = Wires();
      sent_.clear();
      NewCore();
      instances_ = 0;
      auto start = [&] {
        Start();
        prog_->keeps_writes_until_sync = program.per_node;
        prog_->keeps_changes_per_handle = program.per_handle;
      };
      start();
      Init();
      std::vector<uint64_t> kids;
      for (int i = 0; i < kFiles; ++i) kids.push_back(Lookup(FUSE_ROOT_ID, absl::StrCat("f", i)));
      std::vector<std::string> model(kFiles);
      struct Held {
        int file;
        uint64_t fh;
      };
      std::vector<Held> held;
      auto check = [&](const std::string& reply, const std::string& what) {
        EXPECT_FALSE(reply.empty()) << what << ": no answer";
        EXPECT_EQ(reply.empty() ? 0 : ErrorOf(reply), 0) << what;
        return !reply.empty() && ErrorOf(reply) == 0;
      };
      auto open_file = [&](int f, bool trunc) {
        fuse_open_in in{};
        in.flags = O_RDWR | (trunc ? O_TRUNC : 0);
        const std::string r = Call(FUSE_OPEN, kids[f], Bytes(in));
        if (!check(r, "OPEN")) return;
        if (trunc) model[f].clear();
        held.push_back({f, Load<fuse_open_out>(r.data() + sizeof(fuse_out_header)).fh});
      };
      for (int f = 0; f < kFiles; ++f) open_file(f, false);
      int wrong_reads = 0;
      for (int step = 0; step < 250; ++step) {
        const Held h = held[rng() % held.size()];
        const int f = h.file;
        switch (rng() % 11) {
          case 0:
          case 1:
          case 2: {  // pwrite (holes included)
            const uint64_t off = rng() % (model[f].size() + 64);
            const std::string data(1 + rng() % 48, static_cast<char>('a' + rng() % 26));
            // Sometimes the program does it and dies before its answer gets out: the kernel's
            // request waits and goes to the next instance.
            const bool die = rng() % 8 == 0;
            const uint64_t u = Send(FUSE_WRITE, kids[f], WriteBody(h.fh, off, data));
            if (die) {
              DoWorkThenKill();
              start();
            }
            Pump();
            if (check(ReplyTo(u), "WRITE")) {
              if (model[f].size() < off + data.size()) model[f].resize(off + data.size());
              model[f].replace(off, data.size(), data);
            }
            break;
          }
          case 3: {  // ftruncate (through the handle) or truncate (by path), shorter or longer
            fuse_setattr_in in{};
            in.valid = FATTR_SIZE;
            if (rng() % 2) {
              in.valid |= FATTR_FH;
              in.fh = h.fh;
            }
            in.size = rng() % (model[f].size() + 32);
            if (check(Call(FUSE_SETATTR, kids[f], Bytes(in)), "SETATTR")) model[f].resize(in.size);
            break;
          }
          case 4: {  // fsync
            fuse_fsync_in in{};
            in.fh = h.fh;
            check(Call(FUSE_FSYNC, kids[f], Bytes(in)), "FSYNC");
            break;
          }
          case 5: {  // close (FLUSH, RELEASE) and open again, sometimes with O_TRUNC
            fuse_flush_in fl{};
            fl.fh = h.fh;
            check(Call(FUSE_FLUSH, kids[f], Bytes(fl)), "FLUSH");
            fuse_release_in rel{};
            rel.fh = h.fh;
            check(Call(FUSE_RELEASE, kids[f], Bytes(rel)), "RELEASE");
            for (size_t i = 0; i < held.size(); ++i) {
              if (held[i].fh == h.fh) {
                held.erase(held.begin() + static_cast<long>(i));
                break;
              }
            }
            open_file(f, rng() % 3 == 0);
            break;
          }
          case 6:  // another handle on the same file
            if (held.size() < 6) open_file(f, false);
            break;
          case 7:
          case 8: {  // pread, checked against the model
            const std::string r = Call(FUSE_READ, kids[f], ReadBody(kids[f], h.fh, 0, 4096));
            if (check(r, "READ") && r.substr(sizeof(fuse_out_header)) != model[f]) {
              ++wrong_reads;
              ADD_FAILURE() << "step " << step << ": f" << f << " read " << r.size() - sizeof(fuse_out_header)
                            << " bytes, the model has " << model[f].size();
            }
            break;
          }
          case 9:  // kill -9 of the program
            Kill();
            start();
            Pump();
            break;
          case 10:  // of the launcher, and so of its program
            if (rng() % 3 != 0) break;
            KillLauncher();
            start();
            Pump();
            break;
        }
        if (wrong_reads > 3) break;
      }
      // Read fresh: a last death, and every file read through a new handle.
      Kill();
      start();
      Pump();
      for (int f = 0; f < kFiles; ++f) {
        const uint64_t fh = Open(kids[f], O_RDONLY);
        const std::string r = Call(FUSE_READ, kids[f], ReadBody(kids[f], fh, 0, 4096));
        if (check(r, "READ after")) {
          EXPECT_EQ(r.substr(sizeof(fuse_out_header)), model[f]) << "f" << f;
        }
      }
      // Everything synced and the program stopped cleanly: the disk holds the model.
      for (const Held& h : held) {
        fuse_fsync_in in{};
        in.fh = h.fh;
        check(Call(FUSE_FSYNC, kids[h.file], Bytes(in)), "FSYNC at the end");
      }
      for (int f = 0; f < kFiles; ++f) EXPECT_EQ(disk_.inodes[inos[f]].data, model[f]) << "f" << f << " on the disk";
      EXPECT_EQ(core_.stats().files_lost, 0u);
    }
  }
}

}  // namespace
}  // namespace fusekeeper::relay
