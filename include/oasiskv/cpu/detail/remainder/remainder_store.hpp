// RemainderStore<T>: the CPU engine's one seam to the remainder estimate (CacheConfig::remainder,
// Cache::remainder): what an estimate keeps beside the host tier and the block summaries, kept
// current by append, truncate and fork, and its estimate of the attention over the blocks a view
// leaves out. One implementation per estimate (clusters.hpp, quantized.hpp), chosen once by
// make_remainder_store (make_remainder_store.hpp); with `none` the engine holds no store. The
// engine calls the hooks after its own work on the host rows and summaries, which the store reads.
#pragma once

#include <cstdint>
#include <span>

#include "oasiskv/admission.hpp"
#include "oasiskv/dtype.hpp"
#include "oasiskv/view.hpp"

namespace oasiskv {
inline namespace v0 {
namespace detail {

template <KvElement T>
class RemainderStore {
 public:
  virtual ~RemainderStore() = default;

  // An append wrote rows [from, to) of (slot, layer): host rows and key summaries are final for
  // them.
  virtual void appended(int slot, int layer, std::int64_t from, std::int64_t to) = 0;
  // (slot, layer) now ends at `length` rows (its partial block's summary already refolded).
  virtual void truncated(int slot, int layer, std::int64_t length) = 0;
  // dst (a fresh sequence) is now the first `length` rows of src at `layer`: its host blocks are
  // src's and its summaries copied and refolded.
  virtual void forked(int src, int dst, int layer, std::int64_t length) = 0;
  // A new sequence in `slot`.
  virtual void reset(int slot) = 0;

  // For batch entry `entry` of q ([entries * rows][num_q_heads][head_dim], element type T or
  // float) and each of its `rows` rows and each query head of kv head `kv_head`'s group: the
  // estimated attention state over the blocks of [0, blocks_for(length)) of (slot, layer,
  // kv_head) outside `resident` (ascending). out: [entries * rows][num_q_heads][head_dim], lse:
  // [entries * rows][num_q_heads], written at the states of this entry and kv head only.
  virtual void estimate(int slot, int layer, int kv_head, std::int64_t length, std::span<const std::int32_t> resident,
                        const RowsView& q, std::int64_t entry, std::int64_t rows, float* out, float* lse) = 0;

  // Prefill-decode: what the estimate adds to the admission message of a sequence of `length`
  // rows (make_admission), and what an admitted sequence takes from it (check_admission
  // checked the message against this cache first).
  virtual void export_admission(int slot, std::int64_t length, AdmissionMessage& m) const = 0;
  virtual void admit(int slot, const AdmissionMessage& m) = 0;
};

}  // namespace detail
}  // namespace v0
}  // namespace oasiskv
