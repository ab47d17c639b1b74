#include "gguf_reader.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace smollm2 {
namespace {

// GGUF metadata value type ids.
enum : std::uint32_t {
  kU8 = 0, kI8, kU16, kI16, kU32, kI32, kF32, kBool, kString, kArray, kU64, kI64, kF64
};

// Bounds-checked little-endian cursor over the mapped file.
class Cursor {
 public:
  Cursor(const std::byte* base, std::size_t size, const std::string& path)
      : base_(base), size_(size), path_(path) {}
  template <class T>
  T read() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string read_string() {
    auto length = read<std::uint64_t>();
    need(length);
    std::string s(reinterpret_cast<const char*>(base_ + pos_), length);
    pos_ += length;
    return s;
  }
  std::size_t position() const { return pos_; }

 private:
  void need(std::uint64_t bytes) const {
    if (bytes > size_ - pos_)
      throw std::runtime_error(path_ + ": GGUF file truncated at byte " + std::to_string(pos_));
  }
  const std::byte* base_;
  std::size_t size_;
  std::size_t pos_ = 0;
  const std::string& path_;
};

std::int64_t read_integer(Cursor& c, std::uint32_t type) {
  switch (type) {
    case kU8: return c.read<std::uint8_t>();
    case kI8: return c.read<std::int8_t>();
    case kU16: return c.read<std::uint16_t>();
    case kI16: return c.read<std::int16_t>();
    case kU32: return c.read<std::uint32_t>();
    case kI32: return c.read<std::int32_t>();
    case kU64: return static_cast<std::int64_t>(c.read<std::uint64_t>());
    case kI64: return c.read<std::int64_t>();
    default: throw std::logic_error("not an integer type");
  }
}

bool is_integer(std::uint32_t t) {
  return t <= kI32 || t == kU64 || t == kI64;
}

MetadataValue read_value(Cursor& c, std::uint32_t type, const std::string& key) {
  MetadataValue v;
  if (is_integer(type)) {
    v.kind = MetadataValue::Kind::integer;
    v.integer = read_integer(c, type);
  } else if (type == kF32 || type == kF64) {
    v.kind = MetadataValue::Kind::real;
    v.real = type == kF32 ? c.read<float>() : c.read<double>();
  } else if (type == kBool) {
    v.kind = MetadataValue::Kind::boolean;
    v.boolean = c.read<std::uint8_t>() != 0;
  } else if (type == kString) {
    v.kind = MetadataValue::Kind::string;
    v.string = c.read_string();
  } else if (type == kArray) {
    v.kind = MetadataValue::Kind::array;
    auto item_type = c.read<std::uint32_t>();
    auto count = c.read<std::uint64_t>();
    for (std::uint64_t i = 0; i < count; ++i) {
      if (is_integer(item_type)) v.integers.push_back(read_integer(c, item_type));
      else if (item_type == kF32) v.reals.push_back(c.read<float>());
      else if (item_type == kF64) v.reals.push_back(c.read<double>());
      else if (item_type == kBool) v.integers.push_back(c.read<std::uint8_t>());
      else if (item_type == kString) v.strings.push_back(c.read_string());
      else throw std::runtime_error("GGUF key '" + key + "': unsupported array item type " +
                                    std::to_string(item_type));
    }
  } else {
    throw std::runtime_error("GGUF key '" + key + "': unknown value type " + std::to_string(type));
  }
  return v;
}

// Bytes one row of `elements` values takes in a given tensor type.
std::uint64_t tensor_bytes(std::uint32_t type, std::int64_t elements, const std::string& name) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::f32: return 4ull * elements;
    case GgmlType::f16: return 2ull * elements;
    case GgmlType::q4_0: return elements / 32 * 18;
    case GgmlType::q4_1: return elements / 32 * 20;
    case GgmlType::q8_0: return elements / 32 * 34;
  }
  throw std::runtime_error("tensor '" + name + "' has type " + ggml_type_name(type) +
                           ", which this engine does not dequantise");
}

}  // namespace

const char* ggml_type_name(std::uint32_t type) {
  switch (type) {
    case 0: return "F32";
    case 1: return "F16";
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 8: return "Q8_0";
    case 10: return "Q2_K";
    case 11: return "Q3_K";
    case 12: return "Q4_K";
    case 13: return "Q5_K";
    case 14: return "Q6_K";
    case 30: return "BF16";
    default: return "unknown";
  }
}

std::int64_t TensorInfo::elements() const {
  std::int64_t n = 1;
  for (auto d : dims) n *= d;
  return n;
}

GgufFile::GgufFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open model file '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot stat '" + path + "'");
  }
  size_ = static_cast<std::size_t>(st.st_size);
  mapping_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (mapping_ == MAP_FAILED) {
    mapping_ = nullptr;
    throw std::runtime_error("cannot map '" + path + "'");
  }
  try {
    const auto* base = static_cast<const std::byte*>(mapping_);
    Cursor c(base, size_, path_);
    if (c.read<std::uint32_t>() != 0x46554747u)  // "GGUF" little-endian
      throw std::runtime_error(path + " is not a GGUF file (bad magic)");
    version_ = c.read<std::uint32_t>();
    if (version_ < 2 || version_ > 3)
      throw std::runtime_error(path + ": GGUF version " + std::to_string(version_) + " unsupported");
    auto tensor_count = c.read<std::uint64_t>();
    auto kv_count = c.read<std::uint64_t>();
    for (std::uint64_t i = 0; i < kv_count; ++i) {
      auto key = c.read_string();
      auto type = c.read<std::uint32_t>();
      metadata_[key] = read_value(c, type, key);
    }
    for (std::uint64_t i = 0; i < tensor_count; ++i) {
      TensorInfo t;
      t.name = c.read_string();
      auto n_dims = c.read<std::uint32_t>();
      if (n_dims > 4) throw std::runtime_error("tensor '" + t.name + "' has " + std::to_string(n_dims) + " dims");
      for (std::uint32_t d = 0; d < n_dims; ++d) t.dims.push_back(static_cast<std::int64_t>(c.read<std::uint64_t>()));
      t.type = c.read<std::uint32_t>();
      t.offset = c.read<std::uint64_t>();
      tensor_index_[t.name] = tensors_.size();
      tensors_.push_back(std::move(t));
    }
    std::uint64_t alignment = has("general.alignment") ? get_int("general.alignment") : 32;
    std::uint64_t data_start = (c.position() + alignment - 1) / alignment * alignment;
    for (auto& t : tensors_) {
      auto bytes = tensor_bytes(t.type, t.elements(), t.name);
      if (data_start + t.offset + bytes > size_)
        throw std::runtime_error("tensor '" + t.name + "' lies past the end of " + path);
      t.data = base + data_start + t.offset;
    }
  } catch (...) {
    ::munmap(mapping_, size_);
    throw;
  }
}

GgufFile::~GgufFile() {
  if (mapping_) ::munmap(mapping_, size_);
}

const MetadataValue& GgufFile::get(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) throw std::runtime_error(path_ + ": metadata key '" + key + "' missing");
  return it->second;
}

std::int64_t GgufFile::get_int(const std::string& key) const {
  const auto& v = get(key);
  if (v.kind == MetadataValue::Kind::integer) return v.integer;
  if (v.kind == MetadataValue::Kind::boolean) return v.boolean;
  throw std::runtime_error(path_ + ": metadata key '" + key + "' is not an integer");
}

double GgufFile::get_real(const std::string& key) const {
  const auto& v = get(key);
  if (v.kind == MetadataValue::Kind::real) return v.real;
  if (v.kind == MetadataValue::Kind::integer) return static_cast<double>(v.integer);
  throw std::runtime_error(path_ + ": metadata key '" + key + "' is not a number");
}

const std::string& GgufFile::get_string(const std::string& key) const {
  const auto& v = get(key);
  if (v.kind != MetadataValue::Kind::string)
    throw std::runtime_error(path_ + ": metadata key '" + key + "' is not a string");
  return v.string;
}

const TensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& GgufFile::tensor(const std::string& name) const {
  if (const auto* t = find_tensor(name)) return *t;
  throw std::runtime_error(path_ + ": tensor '" + name + "' missing");
}

}  // namespace smollm2
