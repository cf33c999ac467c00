// fusekeeper: the node agent. Flags are read here and nowhere else; everything below main()
// takes options structs.
//
// Lifecycle: block SIGTERM/SIGINT → open the kubelet dir and state dir → set up the io_uring
// loop (clear failure if io_uring is unavailable) → BlockingPool → CSI server on the socket →
// run the loop on this thread, whose first job reconciles saved volume state with the mount table.
// On SIGTERM/SIGINT: stop accepting RPCs (UNAVAILABLE, Probe not ready), let in-flight RPCs
// finish within --shutdown_grace_ms, stop the pool, stop the loop, remove the socket, exit 0.
#include <signal.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <functional>
#include <regex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "agent/csi/server.h"
#include "agent/loop/blocking_pool.h"
#include "agent/loop/loop.h"
#include "agent/loop/signals.h"
#include "agent/mount/table_reader.h"
#include "agent/mount/table_watcher.h"
#include "agent/paths/host_path.h"
#include "agent/sys/syscalls.h"
#include "agent/paths/kubelet_dir.h"
#include "agent/volume/state_store.h"
#include "agent/volume/volume_manager.h"
#include "agent/version.h"
#include "gflags/gflags.h"
#include "glog/logging.h"

namespace {

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? std::string(v) : fallback;
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

}  // namespace

DEFINE_string(endpoint, EnvOr("CSI_ENDPOINT", "unix:///csi/csi.sock"),
              "CSI endpoint to listen on, unix:///path/csi.sock (default: $CSI_ENDPOINT)");
DEFINE_string(driver_name, "fusekeeper.csi",
              "CSI driver name reported by GetPluginInfo; must match the CSIDriver object");
DEFINE_string(node_id, "", "node id reported by NodeGetInfo (default: $NODE_NAME, else hostname)");
DEFINE_string(kubelet_dir, "/var/lib/kubelet",
              "kubelet root directory; every target and staging path must be below it");
DEFINE_string(state_dir, "/var/lib/fusekeeper",
              "where volume state that outlives the agent process is kept (host path, 0700)");
DEFINE_int32(stats_timeout_ms, 5000,
             "NodeGetVolumeStats reports a volume abnormal if statfs takes longer than this");
DEFINE_string(ephemeral_host_path_prefixes, "",
              "comma-separated absolute paths below which unstaged (CSI inline ephemeral) "
              "hostPath volumes may be mounted; empty refuses them all (pod authors choose "
              "those paths)");
DEFINE_int32(handoff_timeout_ms, 300000,
             "a FUSE volume no server has claimed by then is aborted, unmounted and forgotten");
DEFINE_int32(pool_threads, 4, "threads for blocking syscalls (mount family)");
DEFINE_int32(pool_max_queued, 1024, "blocking work items allowed to wait before refusing more");
DEFINE_int32(audit_period_ms, 60000,
             "how often every volume's mounts are compared with the mount table, as a safety net "
             "beside mount-table change events and FUSE server connection events");
DEFINE_int32(shutdown_grace_ms, 10000,
             "on SIGTERM, how long in-flight RPCs and blocking work may take to finish");

int main(int argc, char** argv) {
  gflags::SetVersionString(fusekeeper::kVersion);
  gflags::SetUsageMessage("fusekeeper CSI node agent for FUSE volumes");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  // Debian builds abseil with absl::Mutex deadlock detection on, which records every lock in a
  // global graph (gRPC locks absl::Mutex on every call): ~16 % of a publish+unpublish pair here
  // (bench/mount_bench). It is a debugging aid; production does without it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Before any thread exists, so that every thread inherits the mask and the loop's signalfd is
  // the only taker. SIGPIPE: a peer closing a socket must be an error code, not our death.
  fusekeeper::BlockSignals({SIGTERM, SIGINT});
  signal(SIGPIPE, SIG_IGN);

  // Driver names follow the CSI spec (what csi-sanity checks): alphanumeric at both ends,
  // dashes, dots and underscores between, at most 63 characters.
  static const std::regex kDriverName("^[a-zA-Z0-9]([A-Za-z0-9._-]{0,61}[a-zA-Z0-9])?$");
  if (!std::regex_match(FLAGS_driver_name, kDriverName)) {
    LOG(ERROR) << "--driver_name '" << FLAGS_driver_name
               << "' is not a valid CSI driver name: 1-63 characters, alphanumeric at both ends, "
                  "with '-', '_' and '.' allowed between";
    return 2;
  }
  std::string node_id = FLAGS_node_id;
  if (node_id.empty()) node_id = EnvOr("NODE_NAME", HostName());
  if (node_id.empty()) {
    LOG(ERROR) << "no node id: pass --node_id or set NODE_NAME (downward API spec.nodeName)";
    return 2;
  }
  if (FLAGS_pool_threads < 1 || FLAGS_pool_max_queued < 1 || FLAGS_shutdown_grace_ms < 0 ||
      FLAGS_stats_timeout_ms < 1 || FLAGS_handoff_timeout_ms < 1 || FLAGS_audit_period_ms < 1) {
    LOG(ERROR) << "--pool_threads, --pool_max_queued and --stats_timeout_ms must be >= 1, "
                  "--shutdown_grace_ms >= 0";
    return 2;
  }
  auto kubelet = fusekeeper::KubeletDir::Open(FLAGS_kubelet_dir);
  if (!kubelet.ok()) {
    LOG(ERROR) << kubelet.status().message();
    return 2;
  }
  auto store = fusekeeper::StateStore::Open(FLAGS_state_dir);
  if (!store.ok()) {
    LOG(ERROR) << "--state_dir: " << store.status().message();
    return 2;
  }

  auto loop_or = fusekeeper::Loop::Create();
  if (!loop_or.ok()) {
    LOG(ERROR) << loop_or.status().message();
    return 3;
  }
  std::unique_ptr<fusekeeper::Loop> loop = std::move(*loop_or);
  fusekeeper::BlockingPool pool(*loop, {.threads = FLAGS_pool_threads,
                                        .max_queued = static_cast<size_t>(FLAGS_pool_max_queued)});

  auto table_reader = fusekeeper::MountTableReader::Create(*loop);
  if (!table_reader.ok()) {
    LOG(ERROR) << table_reader.status().message();
    return 3;
  }
  std::vector<std::string> ephemeral_prefixes;
  for (absl::string_view p : absl::StrSplit(FLAGS_ephemeral_host_path_prefixes, ',', absl::SkipEmpty())) {
    std::string prefix(p);
    while (prefix.size() > 1 && prefix.back() == '/') prefix.pop_back();
    if (auto s = fusekeeper::ValidateHostPath(prefix); !s.ok()) {
      LOG(ERROR) << "--ephemeral_host_path_prefixes: " << s.message();
      return 2;
    }
    ephemeral_prefixes.push_back(prefix);
  }
  fusekeeper::VolumeManager volumes(*loop, pool, *kubelet, *store, **table_reader,
                                    {.stats_timeout = absl::Milliseconds(FLAGS_stats_timeout_ms),
                                     .ephemeral_host_path_prefixes = ephemeral_prefixes,
                                     .socket_dir = FLAGS_state_dir + "/sockets",
                                     .handoff_timeout = absl::Milliseconds(FLAGS_handoff_timeout_ms)});

  utsname uts{};
  uname(&uts);
  fusekeeper::CsiServerOptions server_options;
  server_options.endpoint = FLAGS_endpoint;
  server_options.identity.driver_name = FLAGS_driver_name;
  server_options.identity.vendor_version = fusekeeper::kVersion;
  const bool statmount = fusekeeper::sys::HaveStatmount();
  LOG(INFO) << "mount lookups use "
            << (statmount ? "statmount (Linux 6.8+)" : "/proc/self/mountinfo (no statmount)");
  server_options.identity.manifest = {
      {"kernel", uts.release},
      {"io_uring", loop->uses_defer_taskrun() ? "single_issuer+defer_taskrun" : "plain"},
      {"mount_lookup", statmount ? "statmount" : "mountinfo"}};
  server_options.identity.ready = [&volumes] { return volumes.ready(); };
  server_options.node.node_id = node_id;
  auto server_or = fusekeeper::CsiServer::Start(*loop, std::move(server_options), &volumes);
  if (!server_or.ok()) {
    LOG(ERROR) << server_or.status().message();
    return 4;
  }
  std::unique_ptr<fusekeeper::CsiServer> server = std::move(*server_or);

  const absl::Duration grace = absl::Milliseconds(FLAGS_shutdown_grace_ms);
  std::thread shutdown_thread;
  auto signals = fusekeeper::SignalWatcher::Create(*loop, {SIGTERM, SIGINT}, [&](int signo) {
    if (shutdown_thread.joinable()) {
      LOG(WARNING) << strsignal(signo) << " again: already shutting down";
      return;
    }
    LOG(INFO) << strsignal(signo) << ": shutting down (grace " << grace << ")";
    server->BeginDraining();
    // The blocking half of shutdown runs off the loop, which keeps serving in-flight work.
    shutdown_thread = std::thread([&] {
      server->Shutdown(grace);
      pool.Shutdown(grace);
      loop->Stop();
    });
  });
  if (!signals.ok()) {
    LOG(ERROR) << signals.status().message();
    return 5;
  }

  // Recovery's detection: mount-table change events, a periodic audit, and one at start-up.
  std::unique_ptr<fusekeeper::MountTableWatcher> watcher;
  std::function<void()> periodic_audit = [&] {
    volumes.Audit("periodic audit");
    loop->AddTimer(std::chrono::milliseconds(FLAGS_audit_period_ms), periodic_audit);
  };
  loop->Post([&] {
    volumes.Start([&](absl::Status s) {
      if (!s.ok()) {
        LOG(ERROR) << "reconciling volume state failed: " << s
                   << "; Probe stays not-ready and volume RPCs answer UNAVAILABLE";
        return;
      }
      volumes.Audit("start-up");
      auto w = fusekeeper::MountTableWatcher::Start(*loop, [&volumes](fusekeeper::MountTableWatcher::Done done) {
        volumes.Audit("mount table changed", std::move(done));
      });
      if (w.ok()) {
        watcher = std::move(*w);
      } else {
        LOG(WARNING) << "no mount-table change events (" << w.status()
                     << "); recovery relies on the periodic audit";
      }
      loop->AddTimer(std::chrono::milliseconds(FLAGS_audit_period_ms), periodic_audit);
    });
  });
  LOG(INFO) << "fusekeeper " << fusekeeper::kVersion << " node " << node_id << " driver "
            << FLAGS_driver_name << " kubelet_dir " << kubelet->path() << " state_dir "
            << FLAGS_state_dir << " serving";
  loop->Run();
  if (shutdown_thread.joinable()) shutdown_thread.join();
  server.reset();
  watcher.reset();
  LOG(INFO) << "fusekeeper stopped";
  return 0;
}
