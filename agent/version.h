#pragma once

namespace fusekeeper {

// Reported as GetPluginInfo.vendor_version and by --version.
inline constexpr char kVersion[] = "0.1.0";

}  // namespace fusekeeper
