// fkserve's own fusermount: how an unmodified FUSE program is served on the agent's connection.
//
// A program that cannot mount by itself (an unprivileged container never can) asks `fusermount`
// (libfuse2, bazil) or `fusermount3` (libfuse3, go-fuse) to mount its directory: it runs it with
// `-o <options> -- <mountpoint>` and `_FUSE_COMMFD=<fd>` (one end of a socket pair) in the
// environment, and receives the /dev/fuse fd back on that socket with SCM_RIGHTS (one data byte).
// `fkserve launch` puts this fusermount first (PATH, and an LD_PRELOAD shim for the absolute path
// libfuse execs first): instead of mounting, it answers with the connection the agent handed to
// the launcher (FKSERVE_FUSE_FD, inherited). The options the program asked for are compared with
// what the agent mounted: harmless ones are accepted; ones that would change what the pod sees
// or its security are reported (stderr, and the launcher's report to the agent), never silently
// dropped. `fusermount -u` unmounts nothing: the agent owns the mount.
//
// Blocking; runs as its own process (argv[0] "fusermount"/"fusermount3", a link to fkserve).
#pragma once

#include <string>
#include <vector>

namespace fusekeeper {

// Environment the launcher sets for the program (and so for its fusermount).
inline constexpr char kFuseFdEnv[] = "FKSERVE_FUSE_FD";          // the connection (inherited fd)
inline constexpr char kMountpointEnv[] = "FKSERVE_MOUNTPOINT";    // the directory given to the program
inline constexpr char kReportFdEnv[] = "FKSERVE_REPORT_FD";       // a pipe to the launcher
inline constexpr char kAgentReadOnlyEnv[] = "FKSERVE_AGENT_RO";   // "1": the agent mounted read-only
inline constexpr char kFusermountEnv[] = "FKSERVE_FUSERMOUNT";    // this shim's path (LD_PRELOAD shim)
inline constexpr char kHandedMarkerEnv[] = "FKSERVE_HANDED";      // a file created at the first handover

// What becomes of the mount options a program asks fusermount for.
struct OptionVerdict {
  std::vector<std::string> accepted;     // harmless, or what the agent's mount does anyway
  std::vector<std::string> not_applied;  // would change what the pod sees or its security: reported
};
// `options`: the comma-separated -o argument(s). `agent_read_only`: how the agent mounted.
OptionVerdict ClassifyMountOptions(const std::vector<std::string>& options, bool agent_read_only);

// The fusermount entry point (argv as given to it). Returns the exit status.
int FusermountMain(int argc, char** argv);

// Whether argv[0] names fusermount (fkserve is run through links of that name).
bool IsFusermountName(const char* argv0);

}  // namespace fusekeeper
