// Reader for GGUF (version 2 and 3) model files: metadata key/values and tensor descriptions.
// The file is memory-mapped; tensor data pointers stay valid as long as the GgufFile lives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace smollm2 {

// The GGML tensor element types this engine understands (values are GGUF's ids).
enum class GgmlType : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q8_0 = 8,
};
const char* ggml_type_name(std::uint32_t type);

// One metadata value. Scalars are widened (integers to int64, floats to double); arrays keep
// their items in the vector matching their element type.
struct MetadataValue {
  enum class Kind { integer, real, boolean, string, array } kind = Kind::integer;
  std::int64_t integer = 0;
  double real = 0.0;
  bool boolean = false;
  std::string string;
  std::vector<std::int64_t> integers;  // array of integers
  std::vector<double> reals;           // array of floats
  std::vector<std::string> strings;    // array of strings
};

struct TensorInfo {
  std::string name;
  std::vector<std::int64_t> dims;  // GGUF order: dims[0] is the contiguous (innermost) one
  std::uint32_t type = 0;
  std::uint64_t offset = 0;        // relative to the data section
  const std::byte* data = nullptr;
  std::int64_t elements() const;
};

class GgufFile {
 public:
  explicit GgufFile(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  std::uint32_t version() const { return version_; }
  bool has(const std::string& key) const { return metadata_.count(key) != 0; }
  const MetadataValue& get(const std::string& key) const;  // throws naming the key when missing
  std::int64_t get_int(const std::string& key) const;
  double get_real(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(const std::string& name) const;  // nullptr when absent
  const TensorInfo& tensor(const std::string& name) const;       // throws when absent

 private:
  std::string path_;
  std::uint32_t version_ = 0;
  void* mapping_ = nullptr;
  std::size_t size_ = 0;
  std::map<std::string, MetadataValue> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> tensor_index_;
};

}  // namespace smollm2
