// StateJournal: what a new launcher reads back is the last state written, whatever point the old
// one was killed at (a torn record, a compaction cut short), and anything that is not a journal is
// refused with a reason, never a crash.
#include "agent/fkserve/relay/relay_state.h"

#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include "agent/base/unique_fd.h"
#include "gtest/gtest.h"

namespace fusekeeper::relay {
namespace {

std::string FileOf(int fd) {
  struct stat st;
  EXPECT_EQ(fstat(fd, &st), 0);
  std::string out(static_cast<size_t>(st.st_size), '\0');
  EXPECT_EQ(pread(fd, out.data(), out.size(), 0), static_cast<ssize_t>(out.size()));
  return out;
}

SavedState Reopen(const StateJournal& j, std::unique_ptr<StateJournal>* out = nullptr) {
  SavedState s;
  auto opened = StateJournal::Open(UniqueFd(dup(j.fd())), &s);
  EXPECT_TRUE(opened.ok()) << opened.status();
  if (out != nullptr && opened.ok()) *out = std::move(*opened);
  return s;
}

std::string WriteRequest(const std::string& data) { return std::string(80, 'h') + data; }

TEST(StateJournalTest, LastRecordWins) {
  auto j = *StateJournal::Create();
  j->Init(std::string(56, 'i'), 131072);
  j->Node(5, {1, "a", 1});
  j->Node(6, {5, "b", 2});
  j->Node(5, {1, "a", 3});
  j->Handle(1, {6, 2, false, false, true});
  j->Change(6, 1, WriteRequest("one"));
  j->Handle(2, {5, 0, true, false, false});
  j->HandleGone(2);
  ASSERT_TRUE(j->Flush());
  const SavedState s = Reopen(*j);
  EXPECT_EQ(s.init_request, std::string(56, 'i'));
  EXPECT_EQ(s.max_write, 131072u);
  ASSERT_EQ(s.nodes.size(), 2u);
  EXPECT_EQ(s.nodes.at(5).kernel_lookups, 3u);
  EXPECT_EQ(s.nodes.at(6).name, "b");
  ASSERT_EQ(s.handles.size(), 1u);
  EXPECT_TRUE(s.handles.at(1).written);
  ASSERT_NE(s.changes.Find(6), nullptr);
  ASSERT_EQ(s.changes.Find(6)->changes.size(), 1u);
  EXPECT_EQ(s.changes.Find(6)->changes[0].msg, WriteRequest("one"));
  EXPECT_EQ(s.changes.Find(6)->changes[0].kfh, 1u);
  // Synced through its handle: the kept change goes.
  j->Synced(6, 1);
  j->NodeGone(6);
  ASSERT_TRUE(j->Flush());
  const SavedState t = Reopen(*j);
  EXPECT_EQ(t.changes.Find(6), nullptr);
  EXPECT_EQ(t.nodes.count(6), 0u);
}

// Killed in the middle of writing a record: every prefix of the last write restores the state
// before it; the next launcher appends after the cut and its records count.
TEST(StateJournalTest, ATornRecordIsCutOffAndWrittenOver) {
  auto j = *StateJournal::Create();
  j->Node(5, {1, "kept", 1});
  ASSERT_TRUE(j->Flush());
  const std::string whole = FileOf(j->fd());
  j->Node(6, {1, "torn", 1});
  ASSERT_TRUE(j->Flush());
  const std::string with = FileOf(j->fd());
  for (size_t cut = whole.size(); cut < with.size(); ++cut) {
    auto fresh = *StateJournal::Create();
    ASSERT_EQ(pwrite(fresh->fd(), with.data(), cut, 0), static_cast<ssize_t>(cut));
    std::unique_ptr<StateJournal> reopened;
    const SavedState s = Reopen(*fresh, &reopened);
    ASSERT_EQ(s.nodes.size(), 1u) << "cut at " << cut;
    reopened->Node(7, {1, "after", 1});
    ASSERT_TRUE(reopened->Flush());
    const SavedState t = Reopen(*reopened);
    EXPECT_EQ(t.nodes.size(), 2u) << "cut at " << cut;
    EXPECT_EQ(t.nodes.count(7), 1u);
  }
}

// A kept WRITE of 1 MiB (written straight from the message, after what was buffered): read back
// whole, and a journal cut anywhere inside it reads back without it, the records before it kept.
TEST(StateJournalTest, ALargeKeptWriteIsReadBackWholeOrNotAtAll) {
  auto j = *StateJournal::Create();
  j->Node(5, {1, "f", 1});
  j->Handle(1, {5, 1, false, false, true});
  const std::string big = WriteRequest(std::string(1 << 20, 'd'));
  j->Change(5, 1, big);
  j->Node(6, {1, "after", 1});
  ASSERT_TRUE(j->Flush());
  const SavedState s = Reopen(*j);
  ASSERT_NE(s.changes.Find(5), nullptr);
  ASSERT_EQ(s.changes.Find(5)->changes.size(), 1u);
  EXPECT_EQ(s.changes.Find(5)->changes[0].msg, big);
  EXPECT_EQ(s.nodes.count(6), 1u) << "what follows it";
  const std::string file = FileOf(j->fd());
  const size_t before_big = file.find(std::string(80, 'h')) - 8 - 1 - 8 - 8 - 1;  // its header, kid, kfh, durable
  for (size_t cut : {before_big + 20, before_big + 4096, before_big + (1u << 19), file.size() - 60}) {
    auto fresh = *StateJournal::Create();
    ASSERT_EQ(pwrite(fresh->fd(), file.data(), cut, 0), static_cast<ssize_t>(cut));
    const SavedState t = Reopen(*fresh);
    EXPECT_EQ(t.nodes.count(5), 1u) << "cut at " << cut;
    ASSERT_EQ(t.handles.count(1), 1u);
    EXPECT_EQ(t.changes.Find(5), nullptr) << "cut at " << cut;
    EXPECT_EQ(t.nodes.count(6), 0u);
  }
}

// A compaction cut short (the launcher killed before the new log's start was written) leaves
// the old log whole; a finished one frees the old log's memory.
TEST(StateJournalTest, ACompactionCutShortLeavesTheOldLog) {
  auto j = *StateJournal::Create();
  for (uint64_t i = 2; i < 30000; ++i) j->Node(i, {1, "n" + std::to_string(i), i});
  for (uint64_t i = 3; i < 30000; ++i) j->NodeGone(i);
  ASSERT_TRUE(j->Flush());
  EXPECT_TRUE(j->WantsCompaction(/*live_bytes=*/64)) << "60000 records, one live";
  EXPECT_FALSE(j->WantsCompaction(/*live_bytes=*/j->log_bytes())) << "a log of live records is not copied";
  j->BeginCompaction();
  j->Node(2, {1, "n2", 2});
  ASSERT_TRUE(j->Flush());  // the new log is written, its start not yet
  uint64_t end;
  SavedState s = *StateJournal::Parse(FileOf(j->fd()), &end);  // what a successor would read
  EXPECT_EQ(s.nodes.size(), 1u);
  EXPECT_EQ(s.nodes.at(2).kernel_lookups, 2u);
  ASSERT_TRUE(j->EndCompaction());
  EXPECT_LT(j->log_bytes(), 100u);
  s = Reopen(*j);
  ASSERT_EQ(s.nodes.size(), 1u);
  EXPECT_EQ(s.nodes.at(2).name, "n2");
  struct stat st;
  ASSERT_EQ(fstat(j->fd(), &st), 0);
  EXPECT_LT(st.st_blocks * 512, 64 * 1024) << "the old log's pages are given back";
}

// The ChangeLog's operations, read back, make the same log: order, durable changes kept behind
// one that is not, a node made incomplete, and a drop.
TEST(StateJournalTest, KeptChangesReadBackInTheirOrder) {
  auto j = *StateJournal::Create();
  ChangeLog log;
  auto change = [&](uint64_t kid, uint64_t kfh, const std::string& data) {
    j->Change(kid, kfh, WriteRequest(data));
    log.Add(kid, kfh, WriteRequest(data));
  };
  auto synced = [&](uint64_t kid, uint64_t kfh) {
    j->Synced(kid, kfh);
    log.Synced(kid, kfh);
  };
  change(5, 1, "a");
  change(5, 2, "b");
  change(5, 0, "truncate");
  change(5, 1, "c");
  synced(5, 2);  // b and the truncate are durable, but kept behind a
  change(6, 3, "x");
  j->Unrepeatable(7, 4);
  log.AddUnrepeatable(7, 4);
  change(8, 5, "gone");
  j->DropChanges(8);
  log.Drop(8);
  ASSERT_TRUE(j->Flush());
  const SavedState s = Reopen(*j);
  auto same = [](const ChangeLog& a, const ChangeLog& b) {
    if (a.nodes().size() != b.nodes().size() || a.bytes() != b.bytes()) return false;
    for (const auto& [kid, n] : a.nodes()) {
      const NodeChanges* m = b.Find(kid);
      if (m == nullptr || m->incomplete != n.incomplete || m->unsynced_handles != n.unsynced_handles ||
          m->changes.size() != n.changes.size()) {
        return false;
      }
      for (size_t i = 0; i < n.changes.size(); ++i) {
        if (m->changes[i].kfh != n.changes[i].kfh || m->changes[i].durable != n.changes[i].durable ||
            m->changes[i].msg != n.changes[i].msg) {
          return false;
        }
      }
    }
    return true;
  };
  EXPECT_TRUE(same(s.changes, log));
  ASSERT_NE(s.changes.Find(5), nullptr);
  ASSERT_EQ(s.changes.Find(5)->changes.size(), 4u);
  EXPECT_FALSE(s.changes.Find(5)->changes[0].durable);
  EXPECT_TRUE(s.changes.Find(5)->changes[1].durable);
  EXPECT_TRUE(s.changes.Find(7)->incomplete);
  EXPECT_EQ(s.changes.Find(8), nullptr);
  synced(5, 1);
  ASSERT_TRUE(j->Flush());
  EXPECT_EQ(Reopen(*j).changes.Find(5), nullptr) << "all durable: nothing kept";
}

// The replies to non-idempotent requests: the last kKeptAnswers, oldest first, through a
// compaction too; one whose length is not its header's is refused.
TEST(StateJournalTest, TheLastAnswersAreKeptInTheirOrder) {
  auto answer = [](uint64_t unique, size_t body) {
    std::string r(16 + body, 'a');
    const uint32_t len = static_cast<uint32_t>(r.size());
    memcpy(r.data(), &len, 4);
    memcpy(r.data() + 8, &unique, 8);
    return r;
  };
  auto reply_to = [&](uint64_t u) { return answer(u, u % 7 == 0 ? 144 : 0); };  // some with an entry
  auto j = *StateJournal::Create();
  for (uint64_t u = 2; u < 2 + 2 * (kKeptAnswers + 6); u += 2) j->Answer(u, reply_to(u));
  ASSERT_TRUE(j->Flush());
  SavedState s = Reopen(*j);
  ASSERT_EQ(s.answers.size(), kKeptAnswers);
  EXPECT_EQ(s.answers.front().unique, 2u + 2 * 6);
  EXPECT_EQ(s.answers.back().unique, 2u * (kKeptAnswers + 6));
  EXPECT_EQ(s.answers.back().reply, reply_to(2 * (kKeptAnswers + 6)));
  // What a compaction writes (RelayCore::WriteState: each kept answer again) reads back the same.
  j->BeginCompaction();
  for (const SavedAnswer& a : s.answers) j->Answer(a.unique, a.reply);
  ASSERT_TRUE(j->EndCompaction());
  const SavedState t = Reopen(*j);
  ASSERT_EQ(t.answers.size(), kKeptAnswers);
  EXPECT_EQ(t.answers.front().unique, s.answers.front().unique);
  uint64_t end;
  auto k = *StateJournal::Create();
  std::string wrong = answer(4, 16);
  wrong[0] = 3;  // its header says 3 bytes
  k->Answer(4, wrong);
  ASSERT_TRUE(k->Flush());
  auto bad = StateJournal::Parse(FileOf(k->fd()), &end);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bad answer record"), std::string::npos) << bad.status();
}

TEST(StateJournalTest, WhatIsNotAJournalIsRefusedWithAReason) {
  uint64_t end;
  EXPECT_FALSE(StateJournal::Parse("", &end).ok());
  EXPECT_FALSE(StateJournal::Parse(std::string(4096, 'x'), &end).ok());
  // A record whose check holds but whose content is nonsense (a node named with a slash).
  auto j = *StateJournal::Create();
  j->Node(5, {1, "a/b", 1});
  ASSERT_TRUE(j->Flush());
  auto bad = StateJournal::Parse(FileOf(j->fd()), &end);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bad node record"), std::string::npos) << bad.status();
  // A kept change too short to be a request.
  auto k = *StateJournal::Create();
  k->Change(9, 1, "x");
  ASSERT_TRUE(k->Flush());
  EXPECT_FALSE(StateJournal::Parse(FileOf(k->fd()), &end).ok());
  // Random damage anywhere never crashes the parser.
  auto good = *StateJournal::Create();
  for (uint64_t i = 2; i < 50; ++i) good->Node(i, {i - 1, "n", 1});
  good->Handle(3, {4, 0, false, false, true});
  good->Change(4, 3, WriteRequest("abcde"));
  good->Synced(4, 3);
  good->Unrepeatable(5, 3);
  good->DropChanges(5);
  good->Answer(8, std::string("\x10\0\0\0\0\0\0\0\x08\0\0\0\0\0\0\0", 16));
  ASSERT_TRUE(good->Flush());
  const std::string file = FileOf(good->fd());
  std::mt19937 rng(7);
  for (int round = 0; round < 2000; ++round) {
    std::string damaged = file.substr(0, rng() % (file.size() + 1));
    for (int i = 0; i < 4 && !damaged.empty(); ++i) damaged[rng() % damaged.size()] = static_cast<char>(rng());
    (void)StateJournal::Parse(damaged, &end);
  }
}

}  // namespace
}  // namespace fusekeeper::relay
