// oasiskv::Error: the one exception type every public call throws on bad input.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace oasiskv {
inline namespace v0 {

// Thrown for invalid arguments and misuse. A call that throws leaves the cache as it was.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Formats the message (it must name the bad value) and throws.
template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace v0
}  // namespace oasiskv
