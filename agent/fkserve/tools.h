// `fkserve install-tools <dir>`: copies the launcher into a directory another image can run it
// from — the webhook's init container does this into an emptyDir, so that a FUSE server sidecar
// running the user's own image (s3fs, rclone, …) gets fkserve launch, its fusermount and its
// preload library without the user rebuilding anything.
//
// <dir>/fkserve, <dir>/fkserve-fusermount (static), <dir>/libfkserve_preload.so (libc only), and
// <dir>/lib/: every shared library fkserve has loaded, the dynamic loader among them. Run it as
//   <dir>/lib/<loader> --library-path <dir>/lib <dir>/fkserve --fusermount=<dir>/fkserve-fusermount
//       --preload=<dir>/libfkserve_preload.so … launch -- <program> …
// so that it depends on nothing in the image; the program it starts runs on the image's own
// libraries (no LD_LIBRARY_PATH is set).
//
// Blocking.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace fusekeeper {

// The loader's file name in <dir>/lib (e.g. "ld-linux-x86-64.so.2"), set by InstallToolsBlocking.
absl::Status InstallToolsBlocking(const std::string& dir, std::string* loader_name);

}  // namespace fusekeeper
