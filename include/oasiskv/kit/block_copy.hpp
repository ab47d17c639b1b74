// BlockCopy: one block copy (source, destination, bytes), as the copy engines of every backend
// take it.
#pragma once

#include <cstddef>

namespace oasiskv {
inline namespace v0 {

struct BlockCopy {
  const void* src = nullptr;
  void* dst = nullptr;
  std::size_t bytes = 0;
};

}  // namespace v0
}  // namespace oasiskv
