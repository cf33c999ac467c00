// See ../strings/string_view.h: for libfkserve_preload.so only.
#pragma once
#include <optional>
#include <utility>
#include "absl/status/status.h"
namespace absl {
template <typename T>
class StatusOr {
 public:
  StatusOr(Status s) : status_(std::move(s)) {}  // NOLINT: as Abseil's
  StatusOr(T v) : value_(std::move(v)) {}        // NOLINT
  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }
  T* operator->() { return &*value_; }
  T& value() { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};
}  // namespace absl
