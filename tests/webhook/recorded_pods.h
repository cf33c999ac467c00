// The recorded pod specs in tests/webhook/testdata, for the webhook's tests and benchmark.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace fusekeeper {

// testdata/<name>, parsed.
inline nlohmann::json RecordedPod(const std::string& name) {
  std::ifstream in(RunfilePath("tests/webhook/testdata/" + name));
  std::stringstream s;
  s << in.rdbuf();
  return nlohmann::json::parse(s.str());
}

}  // namespace fusekeeper
