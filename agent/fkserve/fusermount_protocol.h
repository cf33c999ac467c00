// What fkserve's fusermount (fusermount_main.cc) and the launcher's FusermountService
// (fusermount.h) share: the environment the launcher sets, and one message with (or without) an
// fd attached over a Unix socket, which is also how a fusermount hands a FUSE library its fd.
// libc only: fkserve-fusermount is a static binary. Blocking.
#pragma once

#include <string>

namespace fusekeeper {

// Environment the launcher sets for the program (and so for its fusermount).
inline constexpr char kFuseFdEnv[] = "FKSERVE_FUSE_FD";                    // the connection (inherited; preload)
inline constexpr char kServiceSocketEnv[] = "FKSERVE_FUSERMOUNT_SOCKET";  // where the launcher answers
inline constexpr char kFusermountEnv[] = "FKSERVE_FUSERMOUNT";            // the fusermount's path (preload)

// Sends `text` as one message, with `fd` attached if it is >= 0 (SCM_RIGHTS). Retries EINTR.
bool SendWithFd(int sock, const std::string& text, int fd);
// Receives one message into `text`, and the fd it carried into `fd` (-1 if none; close-on-exec).
bool ReceiveWithFd(int sock, std::string* text, int* fd);

}  // namespace fusekeeper
