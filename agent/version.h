#pragma once

// The release, as a string literal (for flag defaults and image tags).
#define FUSEKEEPER_VERSION_STRING "0.1.0"

namespace fusekeeper {

// Reported as GetPluginInfo.vendor_version and by --version.
inline constexpr char kVersion[] = FUSEKEEPER_VERSION_STRING;

}  // namespace fusekeeper
