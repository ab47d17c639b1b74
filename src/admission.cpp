#include "oasiskv/admission.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "oasiskv/detail/checked.hpp"
#include "oasiskv/error.hpp"
#include "oasiskv/kit/find_non_finite.hpp"

namespace oasiskv {
inline namespace v0 {
namespace {

// The wire format is little-endian; every platform the library builds for is.
static_assert(std::endian::native == std::endian::little, "the admission format assumes a little-endian host");

constexpr std::size_t kHeaderBytes = 4 + 4 + 8 + 8;  // magic, version, payload bytes, checksum

std::uint64_t fnv1a(std::span<const std::byte> bytes) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::byte b : bytes) {
    h ^= static_cast<std::uint8_t>(b);
    h *= 0x100000001b3ull;
  }
  return h;
}

class Writer {
 public:
  template <class V>
  void put(V value) {
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    out.insert(out.end(), p, p + sizeof(V));
  }
  // A count, then the elements.
  template <class V>
  void put_array(const std::vector<V>& values) {
    put<std::uint64_t>(values.size());
    const auto* p = reinterpret_cast<const std::byte*>(values.data());
    out.insert(out.end(), p, p + values.size() * sizeof(V));
  }
  std::vector<std::byte> out;
};

// Every read is bounds-checked against what is left, so a truncated or corrupted message fails
// with the field's name instead of reading past the end or allocating a wild count.
class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <class V>
  V get(const char* field) {
    need(sizeof(V), field);
    V value;
    std::memcpy(&value, bytes_.data() + at_, sizeof(V));
    at_ += sizeof(V);
    return value;
  }
  template <class V>
  std::vector<V> get_array(const char* field) {
    const auto count = get<std::uint64_t>(field);
    if (count > (bytes_.size() - at_) / sizeof(V)) {
      fail("admission message: field {} claims {} elements of {} bytes, but only {} bytes are left", field, count,
           sizeof(V), bytes_.size() - at_);
    }
    std::vector<V> values(static_cast<std::size_t>(count));
    if (!values.empty()) std::memcpy(values.data(), bytes_.data() + at_, values.size() * sizeof(V));
    at_ += values.size() * sizeof(V);
    return values;
  }
  std::size_t left() const noexcept { return bytes_.size() - at_; }

 private:
  void need(std::size_t n, const char* field) const {
    if (bytes_.size() - at_ < n) {
      fail("admission message: truncated at field {} ({} bytes needed, {} left)", field, n, bytes_.size() - at_);
    }
  }
  std::span<const std::byte> bytes_;
  std::size_t at_ = 0;
};

// Every count, size and address of the message against its own shape and length: what decode
// checks after parsing, and check_admission for a message built in memory.
void check_fields(const AdmissionMessage& m) {
  const ModelShape& s = m.shape;
  if (s.num_layers <= 0 || s.num_q_heads <= 0 || s.num_kv_heads <= 0 || s.head_dim <= 0 ||
      s.num_q_heads % s.num_kv_heads != 0) {
    fail("admission message: bad shape (layers {}, q heads {}, kv heads {}, head dim {})", s.num_layers, s.num_q_heads,
         s.num_kv_heads, s.head_dim);
  }
  if (m.block_tokens <= 0) fail("admission message: block_tokens must be positive, got {}", m.block_tokens);
  if (m.length < 0 || m.length > std::numeric_limits<std::int32_t>::max() * static_cast<std::int64_t>(m.block_tokens)) {
    fail("admission message: length {} is out of range", m.length);
  }
  // Counts against the shape and length.
  using detail::checked_product;
  const std::int64_t blocks = (m.length + m.block_tokens - 1) / m.block_tokens;
  const std::int64_t heads = checked_product("admission message: layers x kv heads", s.num_layers, s.num_kv_heads);
  const std::int64_t summary_floats =
      checked_product("admission message: summary floats", heads, blocks, 2, s.head_dim);
  if (static_cast<std::int64_t>(m.summaries.size()) != summary_floats) {
    fail("admission message: {} summary floats, but {} layers x {} kv heads x {} blocks x 2 x {} channels need {}",
         m.summaries.size(), s.num_layers, s.num_kv_heads, blocks, s.head_dim, summary_floats);
  }
  if (m.moment_vectors != 0 && m.moment_vectors != 2) {
    fail("admission message: moment_vectors is {}; expected 0 (no block sums) or 2", m.moment_vectors);
  }
  const std::int64_t moment_floats =
      checked_product("admission message: moment floats", heads, blocks, m.moment_vectors, s.head_dim);
  if (static_cast<std::int64_t>(m.moments.size()) != moment_floats) {
    fail(
        "admission message: {} moment floats, but {} layers x {} kv heads x {} blocks x {} vectors x {} channels "
        "need {}",
        m.moments.size(), s.num_layers, s.num_kv_heads, blocks, m.moment_vectors, s.head_dim, moment_floats);
  }
  if (m.run_tokens < 0 || m.run_tokens > m.block_tokens || (m.run_tokens > 0 && m.block_tokens % m.run_tokens != 0)) {
    fail("admission message: run_tokens is {}; expected 0 (no run sums) or a divisor of block_tokens ({})",
         m.run_tokens, m.block_tokens);
  }
  const int runs = m.run_tokens > 0 ? m.block_tokens / m.run_tokens : 0;
  const std::int64_t run_floats = checked_product("admission message: run sum floats", heads, blocks, runs, s.head_dim);
  if (static_cast<std::int64_t>(m.run_sums.size()) != run_floats) {
    fail(
        "admission message: {} run sum floats, but {} layers x {} kv heads x {} blocks x {} runs x {} channels need {}",
        m.run_sums.size(), s.num_layers, s.num_kv_heads, blocks, runs, s.head_dim, run_floats);
  }
  if (m.cluster_segments < 0 || m.cluster_segments > blocks / kClusterSegmentBlocks) {
    fail("admission message: {} clustered segments, outside [0, {}] (the prompt's whole {}-block segments)",
         m.cluster_segments, blocks / kClusterSegmentBlocks, kClusterSegmentBlocks);
  }
  if (m.cluster_segments > 0) {
    const std::int64_t segment_rows = static_cast<std::int64_t>(kClusterSegmentBlocks) * m.block_tokens;
    const int r = m.cluster_rows;
    if (r < 1 || segment_rows % r != 0 || segment_rows / r > 256) {
      fail("admission message: cluster_rows {} does not divide a {}-row segment into at most 256 clusters", r,
           segment_rows);
    }
    const std::int64_t k = segment_rows / r;
    const std::int64_t units = checked_product("admission message: clustered segments", heads, m.cluster_segments);
    if (static_cast<std::int64_t>(m.cluster_ids.size()) !=
            checked_product("admission message: cluster ids", units, segment_rows) ||
        static_cast<std::int64_t>(m.cluster_sums.size()) !=
            checked_product("admission message: cluster sums", units, k, 2, s.head_dim) ||
        static_cast<std::int64_t>(m.cluster_counts.size()) !=
            checked_product("admission message: cluster counts", units, k)) {
      fail(
          "admission message: {} cluster ids, {} cluster sum floats and {} cluster counts do not fit {} layers x {} kv "
          "heads x {} segments of {} rows and {} clusters",
          m.cluster_ids.size(), m.cluster_sums.size(), m.cluster_counts.size(), s.num_layers, s.num_kv_heads,
          m.cluster_segments, segment_rows, k);
    }
    for (std::int64_t u = 0; u < units; ++u) {  // the ids name clusters that hold them
      std::vector<std::int32_t> seen(static_cast<std::size_t>(k), 0);
      for (std::int64_t j = 0; j < segment_rows; ++j) {
        const std::uint8_t id = m.cluster_ids[static_cast<std::size_t>(u * segment_rows + j)];
        if (id >= k) fail("admission message: row {} of clustered segment {} names cluster {} of {}", j, u, id, k);
        seen[id] += 1;
      }
      for (std::int64_t c = 0; c < k; ++c) {
        if (seen[static_cast<std::size_t>(c)] != m.cluster_counts[static_cast<std::size_t>(u * k + c)]) {
          fail("admission message: cluster {} of clustered segment {} counts {} rows, its ids name {}", c, u,
               m.cluster_counts[static_cast<std::size_t>(u * k + c)], seen[static_cast<std::size_t>(c)]);
        }
      }
    }
  } else if (!m.cluster_ids.empty() || !m.cluster_sums.empty() || !m.cluster_counts.empty()) {
    fail("admission message: cluster data sent for 0 clustered segments");
  }
  if (static_cast<std::int64_t>(m.working_set_counts.size()) != heads) {
    fail("admission message: {} working-set counts, expected one per (layer, kv head): {}", m.working_set_counts.size(),
         heads);
  }
  std::int64_t listed = 0;
  for (std::size_t p = 0; p < m.working_set_counts.size(); ++p) {
    const std::int32_t n = m.working_set_counts[p];
    if (n < 0 || n > blocks) fail("admission message: working set {} has {} blocks, outside [0, {}]", p, n, blocks);
    if (listed + n > static_cast<std::int64_t>(m.working_set_blocks.size())) {
      fail("admission message: working-set counts list more blocks than the {} ids sent", m.working_set_blocks.size());
    }
    for (std::int32_t j = 0; j < n; ++j) {
      const std::int32_t b = m.working_set_blocks[static_cast<std::size_t>(listed + j)];
      if (b < 0 || b >= blocks) fail("admission message: working set {} holds block {}, outside [0, {})", p, b, blocks);
      if (j > 0 && b <= m.working_set_blocks[static_cast<std::size_t>(listed + j - 1)]) {
        fail("admission message: working set {} is not ascending at block {}", p, b);
      }
    }
    listed += n;
  }
  if (listed != static_cast<std::int64_t>(m.working_set_blocks.size())) {
    fail("admission message: {} working-set block ids sent, the counts add up to {}", m.working_set_blocks.size(),
         listed);
  }
  const std::int64_t block_bytes = checked_product("admission message: block bytes", 2, m.block_tokens, s.head_dim,
                                                   static_cast<std::int64_t>(dtype_size(m.dtype)));
  const std::int64_t row_bytes = checked_product("admission message: working-set bytes", listed, block_bytes);
  if (static_cast<std::int64_t>(m.working_set_rows.size()) != row_bytes) {
    fail("admission message: {} bytes of working-set rows, but {} blocks of {} bytes need {}",
         m.working_set_rows.size(), listed, block_bytes, row_bytes);
  }
  if (static_cast<std::int64_t>(m.block_addresses.size()) != blocks) {
    fail("admission message: {} remote block addresses for {} blocks", m.block_addresses.size(), blocks);
  }
  const auto pool_block_bytes =
      static_cast<std::uint64_t>(checked_product("admission message: remote block bytes", heads, block_bytes));
  if (m.region_base > std::numeric_limits<std::uint64_t>::max() - m.region_bytes) {
    fail("admission message: the remote region [{:#x}, + {}) wraps around", m.region_base, m.region_bytes);
  }
  for (std::size_t b = 0; b < m.block_addresses.size(); ++b) {
    const std::uint64_t a = m.block_addresses[b];
    if (a < m.region_base || a - m.region_base > m.region_bytes ||
        m.region_bytes - (a - m.region_base) < pool_block_bytes) {
      fail(
          "admission message: block {} at remote address {:#x} (+ {} bytes) is outside the registered region [{:#x}, + "
          "{})",
          b, a, pool_block_bytes, m.region_base, m.region_bytes);
    }
  }
  if (m.lookahead_rows < 1) fail("admission message: lookahead_rows must be at least 1, got {}", m.lookahead_rows);
  if (m.next_step_rows < 1) fail("admission message: next_step_rows must be at least 1, got {}", m.next_step_rows);
  const std::int64_t query_floats = checked_product("admission message: lookahead query floats", s.num_layers,
                                                    m.lookahead_rows, s.num_q_heads, s.head_dim);
  if (static_cast<std::int64_t>(m.lookahead_queries.size()) != query_floats) {
    fail("admission message: {} lookahead query floats, but {} layers x {} rows x {} q heads x {} channels need {}",
         m.lookahead_queries.size(), s.num_layers, m.lookahead_rows, s.num_q_heads, s.head_dim, query_floats);
  }
  if (const std::int64_t i =
          detail::find_non_finite(m.lookahead_queries.data(), DType::f32, m.lookahead_queries.size());
      i >= 0) {
    fail("admission message: lookahead query float {} is not finite ({})", i,
         m.lookahead_queries[static_cast<std::size_t>(i)]);
  }
  if (blocks > 0 && m.packed_rkey.empty()) fail("admission message: no remote key for {} remote blocks", blocks);
  // The values a cache would have refused from append (its rows) or derived from such rows: every
  // one finite, as append requires.
  const auto finite = [](std::span<const float> v, const char* what) {
    if (const std::int64_t i = detail::find_non_finite(v.data(), DType::f32, v.size()); i >= 0) {
      fail("admission message: {} float {} is not finite ({})", what, i, v[static_cast<std::size_t>(i)]);
    }
  };
  finite(m.summaries, "summary");
  // A block's channel-wise max is at least its min: a summary folded from real keys can be no
  // other, and scores from bounds the other way round rank blocks by nothing.
  const std::int64_t d = s.head_dim;
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t b = 0; b < blocks; ++b) {
      const float* mx = m.summaries.data() + ((h * blocks + b) * 2) * d;
      for (std::int64_t c = 0; c < d; ++c) {
        if (mx[c] < mx[d + c]) {
          fail(
              "admission message: the summary of block {} (layer {}, kv head {}) has channel {} max {} below its min "
              "{}",
              b, h / s.num_kv_heads, h % s.num_kv_heads, c, mx[c], mx[d + c]);
        }
      }
    }
  }
  finite(m.moments, "moment");
  finite(m.run_sums, "run sum");
  finite(m.cluster_sums, "cluster sum");
  const std::size_t elements = m.working_set_rows.size() / dtype_size(m.dtype);
  if (const std::int64_t i = detail::find_non_finite(m.working_set_rows.data(), m.dtype, elements); i >= 0) {
    fail("admission message: working-set row element {} is not finite ({}): append refuses such rows", i,
         load_as_float(m.working_set_rows.data(), m.dtype, static_cast<std::size_t>(i)));
  }
}

}  // namespace

std::vector<std::byte> encode_admission(const AdmissionMessage& m) {
  Writer payload;
  payload.put<std::uint64_t>(m.request_id);
  payload.put<std::int32_t>(m.shape.num_layers);
  payload.put<std::int32_t>(m.shape.num_q_heads);
  payload.put<std::int32_t>(m.shape.num_kv_heads);
  payload.put<std::int32_t>(m.shape.head_dim);
  payload.put<std::int32_t>(m.block_tokens);
  payload.put<std::uint8_t>(static_cast<std::uint8_t>(m.dtype));
  payload.put<std::int64_t>(m.length);
  payload.put_array(m.summaries);
  payload.put<std::int32_t>(m.moment_vectors);
  payload.put_array(m.moments);
  payload.put<std::int32_t>(m.run_tokens);
  payload.put_array(m.run_sums);
  payload.put<std::int32_t>(m.cluster_rows);
  payload.put<std::int32_t>(m.cluster_segments);
  payload.put_array(m.cluster_ids);
  payload.put_array(m.cluster_sums);
  payload.put_array(m.cluster_counts);
  payload.put_array(m.working_set_counts);
  payload.put_array(m.working_set_blocks);
  payload.put_array(m.working_set_rows);
  payload.put_array(m.block_addresses);
  payload.put<std::uint64_t>(m.region_base);
  payload.put<std::uint64_t>(m.region_bytes);
  payload.put_array(m.packed_rkey);
  payload.put<std::int32_t>(m.lookahead_rows);
  payload.put<std::int64_t>(m.next_step_rows);
  payload.put_array(m.lookahead_queries);
  payload.put_array(m.user_data);
  Writer message;
  message.out.reserve(kHeaderBytes + payload.out.size());
  message.put<std::uint32_t>(kAdmissionMagic);
  message.put<std::uint32_t>(kAdmissionVersion);
  message.put<std::uint64_t>(payload.out.size());
  message.put<std::uint64_t>(fnv1a(payload.out));
  message.out.insert(message.out.end(), payload.out.begin(), payload.out.end());
  return std::move(message.out);
}

AdmissionMessage decode_admission(std::span<const std::byte> bytes) {
  Reader header(bytes);
  if (bytes.size() < kHeaderBytes) {
    fail("admission message: {} bytes, shorter than its {}-byte header", bytes.size(), kHeaderBytes);
  }
  const auto magic = header.get<std::uint32_t>("magic");
  if (magic != kAdmissionMagic)
    fail("admission message: bad magic {:#010x} (expected {:#010x})", magic, kAdmissionMagic);
  const auto version = header.get<std::uint32_t>("version");
  if (version != kAdmissionVersion) {
    fail("admission message: version {} is not supported (this library reads version {})", version, kAdmissionVersion);
  }
  const auto payload_bytes = header.get<std::uint64_t>("payload bytes");
  const auto checksum = header.get<std::uint64_t>("checksum");
  if (payload_bytes != bytes.size() - kHeaderBytes) {
    fail("admission message: the header announces {} payload bytes but {} arrived (truncated or padded)", payload_bytes,
         bytes.size() - kHeaderBytes);
  }
  const auto payload = bytes.subspan(kHeaderBytes);
  if (fnv1a(payload) != checksum) fail("admission message: checksum mismatch (the payload is corrupted)");

  Reader r(payload);
  AdmissionMessage m;
  m.request_id = r.get<std::uint64_t>("request_id");
  m.shape.num_layers = r.get<std::int32_t>("num_layers");
  m.shape.num_q_heads = r.get<std::int32_t>("num_q_heads");
  m.shape.num_kv_heads = r.get<std::int32_t>("num_kv_heads");
  m.shape.head_dim = r.get<std::int32_t>("head_dim");
  m.block_tokens = r.get<std::int32_t>("block_tokens");
  const auto dtype = r.get<std::uint8_t>("dtype");
  m.length = r.get<std::int64_t>("length");
  if (dtype > static_cast<std::uint8_t>(DType::bf16)) fail("admission message: unknown element type {}", dtype);
  m.dtype = static_cast<DType>(dtype);
  m.summaries = r.get_array<float>("summaries");
  m.moment_vectors = r.get<std::int32_t>("moment_vectors");
  m.moments = r.get_array<float>("moments");
  m.run_tokens = r.get<std::int32_t>("run_tokens");
  m.run_sums = r.get_array<float>("run_sums");
  m.cluster_rows = r.get<std::int32_t>("cluster_rows");
  m.cluster_segments = r.get<std::int32_t>("cluster_segments");
  m.cluster_ids = r.get_array<std::uint8_t>("cluster_ids");
  m.cluster_sums = r.get_array<float>("cluster_sums");
  m.cluster_counts = r.get_array<std::int32_t>("cluster_counts");
  m.working_set_counts = r.get_array<std::int32_t>("working_set_counts");
  m.working_set_blocks = r.get_array<std::int32_t>("working_set_blocks");
  m.working_set_rows = r.get_array<std::byte>("working_set_rows");
  m.block_addresses = r.get_array<std::uint64_t>("block_addresses");
  m.region_base = r.get<std::uint64_t>("region_base");
  m.region_bytes = r.get<std::uint64_t>("region_bytes");
  m.packed_rkey = r.get_array<std::byte>("packed_rkey");
  m.lookahead_rows = r.get<std::int32_t>("lookahead_rows");
  m.next_step_rows = r.get<std::int64_t>("next_step_rows");
  m.lookahead_queries = r.get_array<float>("lookahead_queries");
  m.user_data = r.get_array<std::byte>("user_data");
  if (r.left() != 0) fail("admission message: {} unexpected bytes after the last field", r.left());

  check_fields(m);
  return m;
}

void check_admission(const AdmissionMessage& m, const CacheLayout& layout, DType dtype) {
  check_fields(m);  // a message built in memory, not decoded, is checked the same way
  const ModelShape& a = m.shape;
  const ModelShape& b = layout.config.shape;
  if (a.num_layers != b.num_layers || a.num_q_heads != b.num_q_heads || a.num_kv_heads != b.num_kv_heads ||
      a.head_dim != b.head_dim) {
    fail(
        "admission of request {}: its shape (layers {}, q heads {}, kv heads {}, head dim {}) is not the cache's "
        "(layers {}, q heads {}, kv heads {}, head dim {})",
        m.request_id, a.num_layers, a.num_q_heads, a.num_kv_heads, a.head_dim, b.num_layers, b.num_q_heads,
        b.num_kv_heads, b.head_dim);
  }
  if (m.block_tokens != layout.block_tokens()) {
    fail("admission of request {}: blocks of {} tokens, the cache's are {}", m.request_id, m.block_tokens,
         layout.block_tokens());
  }
  if (m.dtype != dtype) {
    fail("admission of request {}: elements are {}, the cache's are {}", m.request_id, dtype_name(m.dtype),
         dtype_name(dtype));
  }
  if (m.length > layout.config.max_tokens_per_sequence) {
    fail("admission of request {}: {} tokens, more than max_tokens_per_sequence = {}", m.request_id, m.length,
         layout.config.max_tokens_per_sequence);
  }
  if (layout.score.runs > 0 && m.run_tokens != layout.config.run_tokens) {
    if (m.run_tokens == 0) {
      fail(
          "admission of request {}: the cache's scorer (runs) reads every block's run key sums, and the message "
          "carries none (the prefill cache keeps none: give it scorer runs too)",
          m.request_id);
    }
    fail("admission of request {}: the message's run sums are of {} rows, the cache's run_tokens is {}", m.request_id,
         m.run_tokens, layout.config.run_tokens);
  }
  if (layout.config.remainder == RemainderEstimate::quantized) {
    fail(
        "admission of request {}: the cache's remainder estimate (quantized) codes every full block from its rows, "
        "and an admitted prompt's rows stay in the prefill process (the message carries no codes); admit into a "
        "cache with another estimate",
        m.request_id);
  }
  if (layout.remainder.moment_vectors > 0 && m.moment_vectors != layout.remainder.moment_vectors) {
    if (m.moment_vectors == 0) {
      fail(
          "admission of request {}: the cache's remainder estimate ({}) needs every block's sums, and the message "
          "carries none (the prefill cache keeps none: give it the same estimate)",
          m.request_id, remainder_name(layout.config.remainder));
    }
    fail(
        "admission of request {}: the message carries {} sum vectors per block, the cache's remainder estimate "
        "({}) keeps {}",
        m.request_id, m.moment_vectors, remainder_name(layout.config.remainder), layout.remainder.moment_vectors);
  }
  if (layout.config.remainder == RemainderEstimate::clusters && m.cluster_segments > 0 &&
      m.cluster_rows != layout.config.remainder_cluster_rows) {
    fail(
        "admission of request {}: its key clusters hold {} rows each on average, the cache's remainder_cluster_rows "
        "is {}",
        m.request_id, m.cluster_rows, layout.config.remainder_cluster_rows);
  }
  // The decode side keeps the sinks and the recent ring locally (appends write the ring), so every
  // working set holds them; the rest of the prompt's blocks stay remote.
  const std::int64_t blocks = layout.blocks_for(m.length);
  std::size_t listed = 0;
  for (std::size_t p = 0; p < m.working_set_counts.size(); ++p) {
    const auto n = static_cast<std::size_t>(m.working_set_counts[p]);
    // With budgets by layer and kv head the prefill side may have chosen for another budget (its
    // own profile, or the uniform one): the decode side plans its own first step from the
    // message's queries, and a working set block it does not select is only not used.
    const int layer = static_cast<int>(p / static_cast<std::size_t>(layout.num_kv_heads()));
    const int head = static_cast<int>(p % static_cast<std::size_t>(layout.num_kv_heads()));
    const int limit = std::max(layout.budget_blocks, layout.head_budget_blocks(layer, head));
    if (m.working_set_counts[p] > limit) {
      fail("admission of request {}: working set {} (layer {}, kv head {}) has {} blocks, more than the budget's {}",
           m.request_id, p, layer, head, m.working_set_counts[p], limit);
    }
    const auto ids = std::span(m.working_set_blocks).subspan(listed, n);
    for (std::int64_t b = 0; b < blocks; ++b) {
      if (!layout.pinned_block(b, m.length)) continue;
      if (!std::binary_search(ids.begin(), ids.end(), static_cast<std::int32_t>(b))) {
        fail(
            "admission of request {}: working set {} (layer {}, kv head {}) lacks block {}, a sink or recent-ring "
            "block, which the decode side keeps locally",
            m.request_id, p, p / static_cast<std::size_t>(layout.num_kv_heads()),
            p % static_cast<std::size_t>(layout.num_kv_heads()), b);
      }
    }
    listed += n;
  }
}

}  // namespace v0
}  // namespace oasiskv
