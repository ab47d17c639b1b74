// Bodies of CudaEngine<T>'s remote-tier hooks (oasiskv/cuda/engine.hpp; the reads themselves:
// oasiskv/cuda/detail/remote_reads.hpp). Host-only.
#pragma once

#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <tuple>

#include "oasiskv/cuda/engine.hpp"  // the declarations (when this file is included on its own)

namespace oasiskv {
inline namespace v0 {

// ---- remote tier (oasiskv/cuda/detail/remote_reads.hpp) ----

// The sinks and the ring local (host pool rows written by the host, pinned slots copied up), the
// other prompt blocks kRemoteBlock in the map, summaries copied up, the working set's remote rows
// kept for the first plans. Everything synchronous: admit is not a decode-path call.
template <KvElement T>
void CudaEngine<T>::admit(int slot, const AdmissionMessage& m, std::shared_ptr<RemoteBlockSource> source) {
  gpu::DeviceGuard guard(device_);
  synchronize();  // no kernel still reads or writes the pool blocks this admission takes
  const int H = layout_.num_kv_heads();
  const std::int64_t nb = layout_.blocks_for(m.length);
  const auto local = [&](std::int64_t b) { return layout_.pinned_block(b, m.length); };
  auto blocks = std::make_shared<gpu::detail::RemoteBlocks>();
  blocks->source = std::move(source);
  blocks->addresses = m.block_addresses;
  blocks->remote.resize(static_cast<std::size_t>(nb));
  for (std::int64_t b = 0; b < nb; ++b) {
    host_.pool().map_next(slot, !local(b));
    blocks->remote[static_cast<std::size_t>(b)] = local(b) ? 0 : 1;
  }
  const auto bytes = static_cast<std::size_t>(layout_.block_elems) * sizeof(T);
  const auto summary_floats = static_cast<std::size_t>(nb) * 2 * static_cast<std::size_t>(layout_.head_dim());
  const auto run_floats = static_cast<std::size_t>(nb) * static_cast<std::size_t>(layout_.score.runs) *
                          static_cast<std::size_t>(layout_.head_dim());  // 0 without the runs scorer
  std::size_t listed = 0;
  for (int l = 0; l < layout_.num_layers(); ++l) {
    for (int h = 0; h < H; ++h) {
      const std::size_t p = static_cast<std::size_t>(l) * static_cast<std::size_t>(H) + static_cast<std::size_t>(h);
      if (nb > 0) {
        OASISKV_CUDA_CHECK(cudaMemcpy(summaries_.data() + layout_.summary_offset(slot, l, h, 0),
                                      m.summaries.data() + p * summary_floats, summary_floats * sizeof(float),
                                      cudaMemcpyHostToDevice));
      }
      if (run_floats > 0) {
        OASISKV_CUDA_CHECK(cudaMemcpy(run_sums_.data() + layout_.run_offset(slot, l, h, 0),
                                      m.run_sums.data() + p * run_floats, run_floats * sizeof(float),
                                      cudaMemcpyHostToDevice));
      }
      for (std::int32_t j = 0; j < m.working_set_counts[p]; ++j, ++listed) {
        const std::int32_t b = m.working_set_blocks[listed];
        const std::byte* rows = m.working_set_rows.data() + listed * bytes;
        if (local(b)) {
          std::memcpy(host_.block(slot, l, h, b), rows, bytes);
          OASISKV_CUDA_CHECK(cudaMemcpy(pool_.slot(l, layout_.slot_id(slot, l, h, layout_.pinned_slot(b))), rows, bytes,
                                        cudaMemcpyHostToDevice));
        } else {
          blocks->staged_at.emplace(std::tuple(l, h, b), blocks->staged.size());
          blocks->staged.insert(blocks->staged.end(), rows, rows + bytes);
        }
      }
    }
  }
  if (remainder_) remainder_->admit(slot, m);  // the estimate's block sums and clusters (check_admission)
  upload_map(slot, 0, nb);
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(compute_));
  remote_[static_cast<std::size_t>(slot)] = std::move(blocks);
}

// Later plans read remotely what the working set held; jobs already queued keep the rows.
template <KvElement T>
void CudaEngine<T>::finish_admission(int slot) {
  auto& r = remote_[static_cast<std::size_t>(slot)];
  if (!r || r->staged.empty()) return;
  auto lean = std::make_shared<gpu::detail::RemoteBlocks>();
  lean->source = r->source;
  lean->addresses = r->addresses;
  lean->remote = r->remote;
  r = std::move(lean);
}

template <KvElement T>
const float* CudaEngine<T>::admission_queries(std::span<const float> q) {
  gpu::DeviceGuard guard(device_);
  admission_queries_ = gpu::DeviceBuffer<float>(q.size());
  if (!q.empty()) {
    OASISKV_CUDA_CHECK(
        cudaMemcpyAsync(admission_queries_.data(), q.data(), q.size_bytes(), cudaMemcpyHostToDevice, compute_));
  }
  return admission_queries_.data();
}

template <KvElement T>
std::string CudaEngine<T>::sequence_failure(int slot) const {
  return remote_failures_.find(slot, generation_[static_cast<std::size_t>(slot)]);
}

// A host function in a graph would read the buffers of the plan it was captured with at every
// replay: remote-backed sequences are planned eagerly only.
template <KvElement T>
void CudaEngine<T>::check_plan(std::span<const int> slots, const char* call) const {
  if (stream_capture_id() == 0) return;
  for (int s : slots) {
    if (remote_[static_cast<std::size_t>(s)]) {
      fail(
          "{}: a sequence admitted from another process (slot {}) reads remote blocks on the host: it cannot be "
          "planned during CUDA graph capture",
          call, s);
    }
  }
}

// The admits of the entries' remote-backed sequences back to the host, then a host function that
// reads their remote blocks into staging (remote_reads.hpp); returns the staging for the gather
// (device address), or nullptr when no entry has remote blocks.
template <KvElement T>
const T* CudaEngine<T>::start_remote_reads(Record& rec, int layer, std::span<const int> entries) {
  const int H = layout_.num_kv_heads();
  const int K = layout_.max_selectable_blocks;  // the admits' row stride
  std::unique_ptr<gpu::detail::RemoteJob> job;
  for (int i : entries) {
    const int s = rec.host_slots[static_cast<std::size_t>(i)];
    const auto& r = remote_[static_cast<std::size_t>(s)];
    if (!r) continue;
    if (!job) job = std::make_unique<gpu::detail::RemoteJob>();
    job->entries.push_back(
        gpu::detail::RemoteJob::Entry{i * H, s, rec.host_generations[static_cast<std::size_t>(i)], r});
  }
  if (!job) return nullptr;
  job->layer = layer;
  job->kv_heads = H;
  job->selectable = K;
  job->block_bytes = static_cast<std::size_t>(layout_.block_elems) * sizeof(T);
  job->pairs = rec.size * H;
  job->failures = &remote_failures_;
  job->buffers = &remote_buffers_;
  job->blocks_read = &remote_blocks_read_[static_cast<std::size_t>(layer)];
  job->buffer = remote_buffers_.take(gpu::detail::RemoteJob::bytes_for(job->pairs, K, job->block_bytes));
  std::byte* base = job->buffer->data();
  const auto pairs = static_cast<std::size_t>(job->pairs);
  OASISKV_CUDA_CHECK(
      cudaMemcpyAsync(base, rec.admit_count.data(), pairs * sizeof(std::int32_t), cudaMemcpyDeviceToHost, copy_.get()));
  OASISKV_CUDA_CHECK(cudaMemcpyAsync(base + gpu::detail::RemoteJob::admits_offset(job->pairs), rec.admits.data(),
                                     pairs * static_cast<std::size_t>(K) * sizeof(gpu::DeviceAdmit),
                                     cudaMemcpyDeviceToHost, copy_.get()));
  const T* staging =
      reinterpret_cast<const T*>(job->buffer->device_data() + gpu::detail::RemoteJob::staging_offset(job->pairs, K));
  OASISKV_CUDA_CHECK(cudaLaunchHostFunc(copy_.get(), &gpu::detail::RemoteJob::run, job.get()));
  (void)job.release();  // the host function owns it now
  rec.remote_reads = true;
  return staging;
}

}  // namespace v0
}  // namespace oasiskv
