#include "agent/config/agent_config.h"

#include <functional>
#include <string>
#include <vector>

#include "gflags/gflags.h"
#include "gtest/gtest.h"

DECLARE_string(node_id);

namespace fusekeeper {
namespace {

// The flags' defaults, with a node id: a valid configuration.
AgentConfig Valid() {
  FLAGS_node_id = "node-1";
  absl::StatusOr<AgentConfig> c = AgentConfig::FromFlags();
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : AgentConfig{};
}

TEST(AgentConfigTest, TheDefaultsWithANodeIdAreValid) {
  const AgentConfig c = Valid();
  EXPECT_EQ(c.node_id, "node-1");
  EXPECT_EQ(c.driver_name, "fusekeeper.csi");
  EXPECT_EQ(c.audit_period, absl::Seconds(60));
  EXPECT_TRUE(c.Check().ok());
}

// Each rule alone: one value changed from a valid configuration, and the error names its flag.
TEST(AgentConfigTest, EachRuleRefusesItsOwnBadValueNamingTheFlag) {
  struct Case {
    std::string flag;
    std::function<void(AgentConfig&)> change;
  };
  const std::vector<Case> cases = {
      {"--driver_name", [](AgentConfig& c) { c.driver_name = "-starts-with-a-dash"; }},
      {"--driver_name", [](AgentConfig& c) { c.driver_name = std::string(64, 'a'); }},
      {"node id", [](AgentConfig& c) { c.node_id.clear(); }},
      {"--readiness_taint", [](AgentConfig& c) { c.readiness_taint = "agent not ready"; }},
      {"--readiness_taint", [](AgentConfig& c) { c.readiness_taint = "Bad_Prefix/ready"; }},
      {"--readiness_taint", [](AgentConfig& c) { c.readiness_taint = "fusekeeper.csi/-x"; }},
      {"--stats_timeout_ms", [](AgentConfig& c) { c.stats_timeout = absl::ZeroDuration(); }},
      {"--handoff_timeout_ms", [](AgentConfig& c) { c.handoff_timeout = absl::ZeroDuration(); }},
      {"--redeposit_wait_ms", [](AgentConfig& c) { c.redeposit_wait = absl::ZeroDuration(); }},
      {"--audit_period_ms", [](AgentConfig& c) { c.audit_period = absl::ZeroDuration(); }},
      {"--kubelet_poll_period_ms", [](AgentConfig& c) { c.kubelet_poll_period = absl::ZeroDuration(); }},
      {"--max_queue_wait_ms", [](AgentConfig& c) { c.max_queue_wait = absl::ZeroDuration(); }},
      {"--probe_loop_stall_ms", [](AgentConfig& c) { c.probe_loop_stall = absl::ZeroDuration(); }},
      {"--server_pod_resync_ms", [](AgentConfig& c) { c.server_pod_resync = absl::ZeroDuration(); }},
      {"--shutdown_grace_ms", [](AgentConfig& c) { c.shutdown_grace = absl::Milliseconds(-1); }},
      {"--server_gone_grace_ms", [](AgentConfig& c) { c.server_gone_grace = absl::Milliseconds(-1); }},
      {"--state_lock_wait_ms", [](AgentConfig& c) { c.state_lock_wait = absl::Milliseconds(-1); }},
      {"--init_timeout_ms", [](AgentConfig& c) { c.init_timeout = absl::Milliseconds(-1); }},
      {"--pool_threads", [](AgentConfig& c) { c.pool_threads = 0; }},
      {"--pool_max_queued", [](AgentConfig& c) { c.pool_max_queued = 0; }},
      {"--max_queued_per_volume", [](AgentConfig& c) { c.max_queued_per_volume = -1; }},
      {"--host_root", [](AgentConfig& c) { c.host_root = "relative/path"; }},
      {"--host_root", [](AgentConfig& c) { c.host_root = "/no/such/directory"; }},
      {"--ephemeral_host_path_prefixes", [](AgentConfig& c) { c.ephemeral_host_path_prefixes = {"relative"}; }},
      {"--server_drain_ms", [](AgentConfig& c) { c.server_drain_ms = -1; }},
      {"--server_drain_ms", [](AgentConfig& c) { c.server_drain_ms = int64_t{c.server_grace_period_s} * 1000; }},
      {"--server_drain_ms", [](AgentConfig& c) { c.server_grace_period_s = 0; }},
      {"--server_seccomp_profile", [](AgentConfig& c) { c.server_seccomp_profile = "Sometimes"; }},
      {"--server_cpu_request", [](AgentConfig& c) { c.server_cpu_request = "lots"; }},
      {"--server_memory_request", [](AgentConfig& c) { c.server_memory_request = "-5Mi"; }},
  };
  for (const Case& k : cases) {
    AgentConfig c = Valid();
    k.change(c);
    const absl::Status s = c.Check();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << k.flag << ": " << s;
    EXPECT_NE(s.message().find(k.flag), std::string::npos) << k.flag << ": " << s.message();
  }
}

TEST(AgentConfigTest, FromFlagsChecksAndTrimsThePrefixes) {
  FLAGS_node_id = "node-1";
  gflags::FlagSaver saver;
  ASSERT_FALSE(gflags::SetCommandLineOption("ephemeral_host_path_prefixes", "/srv/a/,/srv/b").empty());
  absl::StatusOr<AgentConfig> c = AgentConfig::FromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ephemeral_host_path_prefixes, (std::vector<std::string>{"/srv/a", "/srv/b"}));
  ASSERT_FALSE(gflags::SetCommandLineOption("pool_threads", "0").empty());
  EXPECT_TRUE(absl::IsInvalidArgument(AgentConfig::FromFlags().status()));
}

}  // namespace
}  // namespace fusekeeper
