// NodeTable: the kernel's nodes, their paths and both sides' lookup counts, through random
// sequences of entries, forgets, renames, unlinks, handles and new instances; a mutation of
// the bookkeeping (an extra forget, a lost rename) is caught by CheckInvariantsForTest or by
// the forgets owed never matching the lookups given.
#include "agent/fkserve/relay/node_table.h"

#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace fusekeeper::relay {
namespace {

TEST(NodeTableTest, FirstInstanceIdsAreKeptAndCollidingOnesAllocated) {
  NodeTable t;
  EXPECT_EQ(t.AddKernelEntry(kRootId, "a", 7), 7u);
  EXPECT_EQ(t.AddKernelEntry(kRootId, "a", 7), 7u) << "the same node again";
  EXPECT_EQ(t.Find(7)->kernel_lookups, 2u);
  t.NewInstance();
  // The new instance calls something else 7: the kernel's 7 is taken, so it gets another id.
  const uint64_t other = t.AddKernelEntry(kRootId, "b", 7);
  EXPECT_NE(other, 7u);
  EXPECT_GE(other, kFirstAllocatedKid);
  // And "a" is found by its path when the new instance returns it.
  EXPECT_EQ(t.AddKernelEntry(kRootId, "a", 9), 7u);
  EXPECT_EQ(t.Find(7)->pid, 9u);
  EXPECT_EQ(t.CheckInvariantsForTest(), "");
}

TEST(NodeTableTest, TheProgramKeepsAReferenceWhileTheKernelHoldsOne) {
  NodeTable t;
  t.AddKernelEntry(kRootId, "a", 5);
  t.AddKernelEntry(kRootId, "a", 5);
  t.AddKernelEntry(kRootId, "a", 5);
  t.NewInstance();
  t.BindResolved(5, 50);  // the relay's one LOOKUP in the new instance
  t.Forget(5, 2);
  EXPECT_TRUE(t.TakeForgets().empty()) << "the program has one reference; the kernel still one";
  t.Forget(5, 1);
  auto f = t.TakeForgets();
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].pid, 50u);
  EXPECT_EQ(f[0].count, 1u);
  EXPECT_EQ(t.size(), 1u);
}

TEST(NodeTableTest, DirectoriesStayAsPathsForTheirChildren) {
  NodeTable t;
  const uint64_t d = t.AddKernelEntry(kRootId, "d", 2);
  const uint64_t f = t.AddKernelEntry(d, "f", 3);
  t.Forget(d, 1);  // the kernel may drop a directory's inode while a child's stays
  ASSERT_NE(t.Find(d), nullptr) << "kept: it is f's path";
  t.NewInstance();
  t.BindResolved(d, 20);  // resolved only to reach f
  t.BindResolved(f, 30);
  t.Forget(f, 1);
  auto forgets = t.TakeForgets();
  ASSERT_EQ(forgets.size(), 2u) << "f's reference, then d's (kept only for f)";
  EXPECT_EQ(t.size(), 1u);
  EXPECT_EQ(t.CheckInvariantsForTest(), "");
}

TEST(NodeTableTest, PropertyRandomOperations) {
  for (uint32_t seed = 1; seed <= 200; ++seed) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    std::mt19937 rng(seed);
    NodeTable t;
    uint64_t next_pid = 100;
    std::map<uint64_t, uint64_t> kernel;   // kid → lookups the kernel holds
    std::map<uint64_t, uint64_t> program;  // pid → lookups the current instance gave
    std::map<uint64_t, int> handles;
    auto settle = [&] {
      for (const ProgramForget& f : t.TakeForgets()) {
        ASSERT_GE(program[f.pid], f.count) << "forgot more than the program gave";
        program[f.pid] -= f.count;
      }
    };
    std::vector<std::string> names = {"a", "b", "c", "d"};
    for (int step = 0; step < 400; ++step) {
      std::vector<uint64_t> kids;
      for (const auto& [k, n] : kernel) kids.push_back(k);
      const uint64_t parent = kids.empty() || rng() % 3 == 0 ? kRootId : kids[rng() % kids.size()];
      const std::string name = names[rng() % names.size()];
      switch (rng() % 7) {
        case 0:
        case 1: {
          if (parent != kRootId && kernel.find(parent) == kernel.end()) break;
          uint64_t pid = next_pid++;
          const uint64_t existing = t.KidOfName(parent, name);
          if (existing != 0 && t.Find(existing)->pid != 0 && rng() % 2) pid = t.Find(existing)->pid;
          const uint64_t kid = t.AddKernelEntry(parent, name, pid);
          ++kernel[kid];
          ++program[pid];
          break;
        }
        case 2: {
          if (kids.empty()) break;
          const uint64_t kid = kids[rng() % kids.size()];
          const uint64_t n = 1 + rng() % kernel[kid];
          t.Forget(kid, n);
          if ((kernel[kid] -= n) == 0) kernel.erase(kid);
          break;
        }
        case 3:
          t.Rename(parent, name, kRootId, names[rng() % names.size()], rng() % 4 == 0);
          break;
        case 4:
          t.Unlink(parent, name);
          break;
        case 5:
          if (kids.empty()) break;
          if (rng() % 2) {
            const uint64_t kid = kids[rng() % kids.size()];
            t.AddHandle(kid);
            ++handles[kid];
          } else if (!handles.empty()) {
            auto it = std::next(handles.begin(), static_cast<long>(rng() % handles.size()));
            t.DropHandle(it->first);
            if (--it->second == 0) handles.erase(it);
          }
          break;
        case 6:
          if (rng() % 5 != 0) break;
          t.NewInstance();
          program.clear();
          // The new instance resolves some of the kernel's nodes again.
          for (const auto& [kid, n] : kernel) {
            if (rng() % 2 == 0) continue;
            const uint64_t pid = next_pid++;
            t.BindResolved(kid, pid);
            ++program[pid];
          }
          break;
      }
      settle();
      ASSERT_EQ(t.CheckInvariantsForTest(), "") << "step " << step;
      for (const auto& [kid, n] : kernel) {
        const Node* node = t.Find(kid);
        ASSERT_NE(node, nullptr) << "the kernel's node " << kid << " was dropped";
        ASSERT_EQ(node->kernel_lookups, n);
      }
    }
    // The kernel forgets everything: the program gets back all it gave, for nodes bound now.
    for (const auto& [kid, n] : kernel) t.Forget(kid, n);
    for (const auto& [kid, n] : handles) {
      for (int i = 0; i < n; ++i) t.DropHandle(kid);
    }
    settle();
    EXPECT_EQ(t.size(), 1u) << "only the root is left";
    for (const auto& [pid, n] : program) EXPECT_EQ(n, 0u) << "pid " << pid << " still holds " << n;
  }
}

}  // namespace
}  // namespace fusekeeper::relay
