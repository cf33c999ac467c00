// Lower-case hex SHA-256 (names derived from volume ids: socket files, labels, pod names).
#pragma once

#include <string>

namespace fusekeeper {

std::string Sha256Hex(const std::string& data);

}  // namespace fusekeeper
