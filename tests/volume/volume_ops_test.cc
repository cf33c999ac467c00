// UsageOf: statfs numbers as CSI's int64 usage fields, without overflow. s3fs reports 2^40-1
// blocks of 16 MiB; the product overflowed int64 (UBSan: signed integer overflow in
// StatsBlocking), and in a plain build NodeGetVolumeStats reported garbage.
#include <sys/statfs.h>

#include <cstdint>

#include "agent/volume/volume_ops.h"
#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

TEST(UsageOfTest, OrdinaryNumbersAreExact) {
  struct statfs sf {};
  sf.f_bsize = 4096;
  sf.f_frsize = 4096;
  sf.f_blocks = 1000;
  sf.f_bfree = 300;
  sf.f_bavail = 250;
  sf.f_files = 500;
  sf.f_ffree = 120;
  const StatfsUsage u = UsageOf(sf);
  EXPECT_EQ(u.total_bytes, 4096000);
  EXPECT_EQ(u.available_bytes, 1024000);
  EXPECT_EQ(u.used_bytes, 2867200);
  EXPECT_EQ(u.total_inodes, 500);
  EXPECT_EQ(u.available_inodes, 120);
  EXPECT_EQ(u.used_inodes, 380);
}

TEST(UsageOfTest, HugeNumbersSaturateInsteadOfOverflowing) {
  struct statfs sf {};
  sf.f_bsize = 16777216;  // what s3fs says
  sf.f_frsize = 16777216;
  sf.f_blocks = 1099511627775ULL;
  sf.f_bfree = 1099511627775ULL;
  sf.f_bavail = 1099511627775ULL;
  sf.f_files = UINT64_MAX;
  sf.f_ffree = UINT64_MAX;
  const StatfsUsage u = UsageOf(sf);
  EXPECT_EQ(u.total_bytes, INT64_MAX);
  EXPECT_EQ(u.available_bytes, INT64_MAX);
  EXPECT_EQ(u.used_bytes, 0);
  EXPECT_EQ(u.total_inodes, INT64_MAX);
  EXPECT_EQ(u.used_inodes, 0);
}

TEST(UsageOfTest, MoreFreeThanTotalIsNoneUsed) {
  struct statfs sf {};
  sf.f_bsize = 512;
  sf.f_blocks = 10;
  sf.f_bfree = 20;
  sf.f_files = 5;
  sf.f_ffree = 9;
  const StatfsUsage u = UsageOf(sf);
  EXPECT_EQ(u.used_bytes, 0);
  EXPECT_EQ(u.used_inodes, 0);
  EXPECT_EQ(u.total_bytes, 5120) << "f_frsize 0: f_bsize is the unit";
}

}  // namespace
}  // namespace fusekeeper
