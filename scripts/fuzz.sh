#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for SECONDS (default 10)
# from its seed corpus. A crash stops the run and leaves the input in tests/fuzz/crashes/.
#   bash scripts/fuzz.sh            # the short run CI does
#   bash scripts/fuzz.sh 3600       # an hour per target
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-10}"
export DEBIAN_FRONTEND=noninteractive
if ! command -v clang++-14 >/dev/null || [ ! -e /usr/lib/llvm-14/lib/clang/14.0.6/lib/linux/libclang_rt.fuzzer-x86_64.a ]; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends clang-14 libclang-rt-14-dev
fi
bazel build //proto:csi_codegen //proto:state_codegen >/dev/null
gen=$(bazel info bazel-bin 2>/dev/null)
out=$(mktemp -d /tmp/fusekeeper-fuzz.XXXXXX)
mkdir -p tests/fuzz/crashes
CXX="clang++-14 -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I. -I$gen"
ABSL="-labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info -labsl_cord_internal -labsl_cordz_functions -labsl_cordz_handle -labsl_exponential_biased -labsl_str_format_internal -labsl_strerror -labsl_synchronization -labsl_graphcycles_internal -labsl_stacktrace -labsl_symbolize -labsl_debugging_internal -labsl_demangle_internal -labsl_malloc_internal -labsl_time -labsl_civil_time -labsl_time_zone -labsl_strings -labsl_strings_internal -labsl_bad_optional_access -labsl_bad_variant_access -labsl_raw_hash_set -labsl_hash -labsl_city -labsl_low_level_hash -labsl_int128 -labsl_base -labsl_spinlock_wait -labsl_throw_delegate -labsl_raw_logging_internal -labsl_log_severity"
build() {  # name sources... -- libs...
  local name=$1; shift
  echo "building $name"
  $CXX -o "$out/$name" "$@" $ABSL
}
build mountinfo_fuzz tests/fuzz/mountinfo_fuzz.cc agent/mount/mountinfo.cc
build handoff_fuzz tests/fuzz/handoff_fuzz.cc agent/fuse/handoff_protocol.cc agent/base/json.cc agent/base/fd_passing.cc agent/base/status.cc -lsimdjson
build paths_fuzz tests/fuzz/paths_fuzz.cc agent/paths/host_path.cc agent/base/status.cc
build pod_list_fuzz tests/fuzz/pod_list_fuzz.cc agent/kubelet/pod_list.cc -lsimdjson
build csi_request_fuzz tests/fuzz/csi_request_fuzz.cc agent/csi/validate.cc agent/csi/redact.cc "$gen/proto/csi.pb.cc" -lprotobuf
build admission_fuzz tests/fuzz/admission_fuzz.cc agent/webhook/admission.cc agent/webhook/pod_mutation.cc agent/kube/server_container.cc
RELAY="agent/fkserve/relay/relay_core.cc agent/fkserve/relay/relay_core_death.cc agent/fkserve/relay/relay_core_instances.cc agent/fkserve/relay/relay_core_replies.cc agent/fkserve/relay/node_table.cc agent/fkserve/relay/fuse_wire.cc agent/fkserve/relay/relay_state.cc agent/fkserve/relay/change_log.cc agent/fkserve/relay/durability.cc"
build relay_fuzz tests/fuzz/relay_fuzz.cc $RELAY
build relay_state_fuzz tests/fuzz/relay_state_fuzz.cc $RELAY
build server_pods_fuzz tests/fuzz/server_pods_fuzz.cc agent/serverpod/api_objects.cc agent/serverpod/pod_manifest.cc agent/kube/server_container.cc \
  agent/serverpod/server_spec.cc agent/base/sha256.cc agent/fuse/handoff_protocol.cc agent/base/json.cc agent/base/fd_passing.cc agent/base/status.cc \
  "$gen/proto/state.pb.cc" -lprotobuf -lsimdjson -lcrypto
status=0
for t in mountinfo handoff paths csi_request pod_list admission relay relay_state server_pods; do
  corpus="$out/corpus-$t"
  mkdir -p "$corpus" && cp tests/fuzz/corpus/$t/* "$corpus/"
  echo "fuzzing $t for ${seconds}s"
  if ! "$out/${t}_fuzz" -max_total_time="$seconds" -max_len=65536 -artifact_prefix=tests/fuzz/crashes/${t}- \
       -print_final_stats=1 "$corpus" > "$out/$t.log" 2>&1; then
    echo "FUZZ CRASH in $t:"; tail -40 "$out/$t.log"; status=1
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$out/$t.log" | sed "s/^/  $t /"
done
rm -rf "$out"
exit $status
