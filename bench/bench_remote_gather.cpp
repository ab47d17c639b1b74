// The remote tier (oasiskv::ucx), SmolLM2-135M shape (30 layers, 9 query / 3 kv heads, head dim
// 64, f32, 16-token blocks: a (layer, kv head) block is 8 KiB, a pool block 720 KiB).
// BM_RemoteGather: random 8 KiB blocks read in batches (as one prefetch plan's copies read them)
// from a PrefillServer in this process, over UCX_TLS (tcp unless set) on loopback, set against
// ucx_perftest's ucp_get bandwidth on the same link, measured by this binary at startup of the
// benchmark (8 KiB gets with as many outstanding as a batch holds; and 64 KiB).
// BM_RemoteBytesPerStep: bytes a decode step reads remotely, for a real Cache<cpu, float> admitted
// from a prefill cache (a 4,096-token prompt), at fetch ratios 1.0 and 0.05.
#include "bench_support.hpp"

#include <oasiskv/cpu/admission_export.hpp>
#include <oasiskv/ucx/remote_tier.hpp>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

namespace oasiskv::bench {
namespace {

constexpr int kLayers = 30, kQHeads = 9, kHeads = 3, kDim = 64;
constexpr std::size_t kHeadBlock = 2u * kBlockTokens * kDim * sizeof(float);  // 8 KiB
constexpr std::size_t kPoolBlock = kHeadBlock * kLayers * kHeads;             // 720 KiB
constexpr std::int64_t kPrompt = 4096;
constexpr int kPoolBlocks = kPrompt / kBlockTokens;  // 256 (180 MiB exported)
constexpr int kBatches[] = {1, 16, 128, 1024};

// Two spinning threads (reader, exporter) on one CPU take a scheduler slice per round trip (~10 ms
// per read, seen on a loaded 2-CPU VM): both sides are pinned apart, ucx_perftest's processes
// alike (-c). Returns the CPU for `side` (0 reader, 1 exporter), or -1 with a single CPU.
int cpu_of(int side) {
  const int n = static_cast<int>(std::thread::hardware_concurrency());
  return n < 2 ? -1 : (side == 0 ? 0 : n - 1);
}
void pin(pthread_t thread, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (cpu < 0) {
    for (int c = 0; c < static_cast<int>(std::thread::hardware_concurrency()); ++c) CPU_SET(c, &set);
  } else {
    CPU_SET(cpu, &set);
  }
  (void)::pthread_setaffinity_np(thread, sizeof set, &set);
}

// The same transport for our reads and ucx_perftest's (tests/ucx pick tcp too: it works everywhere).
std::string transport() {
  (void)::setenv("UCX_TLS", "tcp", 0);
  return std::getenv("UCX_TLS");
}

// ucx_perftest's ucp_get bandwidth in bytes/s: `size`-byte gets, `outstanding` in flight, server
// and client processes on 127.0.0.1. 0 when ucx_perftest is missing or fails (Debian: ucx-utils).
double perftest_get(std::size_t size, int outstanding) {
  if (std::system("command -v ucx_perftest >/dev/null 2>&1") != 0) return 0.0;
  // About 256 MiB, fewer with few gets in flight (one get at a time is latency-bound).
  const std::size_t iterations =
      std::min<std::size_t>((std::size_t{256} << 20) / size, 2000 * static_cast<std::size_t>(outstanding));
  for (int attempt = 0; attempt < 3; ++attempt) {  // another port if this one was taken
    const int port = 20000 + static_cast<int>((::getpid() * 7 + attempt * 131) % 20000);
    std::ostringstream cmd;
    const std::string server_cpu = cpu_of(1) < 0 ? "" : " -c " + std::to_string(cpu_of(1));
    const std::string client_cpu = cpu_of(0) < 0 ? "" : " -c " + std::to_string(cpu_of(0));
    cmd << "export UCX_TLS=" << transport() << "; timeout 60 ucx_perftest -p " << port << server_cpu
        << " >/dev/null 2>&1 & s=$!; sleep 0.3; timeout 60 ucx_perftest 127.0.0.1 -p " << port << client_cpu << " -t ucp_get -s " << size << " -n "
        << iterations << " -w " << iterations / 10 << " -O " << outstanding << " -f -v 2>/dev/null; wait $s";
    FILE* p = ::popen(cmd.str().c_str(), "r");
    if (p == nullptr) return 0.0;
    // -f -v: a CSV header, then iterations,lat50,lat_avg,lat_overall,bw_avg,bw_overall(MB/s),...
    char line[512];
    double mb = 0.0;
    while (std::fgets(line, sizeof line, p) != nullptr) {
      double f[6];
      if (std::sscanf(line, "%lf,%lf,%lf,%lf,%lf,%lf", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5]) == 6) mb = f[5];
    }
    ::pclose(p);
    if (mb > 0) return mb * 1024.0 * 1024.0;  // ucx_perftest's MB is 2^20 bytes
  }
  return 0.0;
}

struct Peer {
  std::map<int, double> get8k;  // by outstanding gets (= blocks per batch)
  double get64k = 0.0;          // 64 KiB gets, 16 outstanding: what larger messages reach
};

// Measured once, before our server exists: its progress thread would compete for the CPUs.
const Peer& peer() {
  static const Peer p = [] {
    Peer out;
    for (int batch : kBatches) out.get8k[batch] = perftest_get(kHeadBlock, batch);
    out.get64k = perftest_get(65536, 16);
    return out;
  }();
  return p;
}

// Keys with per-block structure (a random centroid per (block, kv head) plus token noise), so
// that block summaries differ as they do in a trained model; values random.
std::vector<float> structured_keys(Random& rng, std::int64_t tokens) {
  std::vector<float> k(static_cast<std::size_t>(tokens * kHeads * kDim));
  std::vector<float> centroid(static_cast<std::size_t>(kHeads * kDim));
  float* out = k.data();
  for (std::int64_t t = 0; t < tokens; ++t) {
    if (t % kBlockTokens == 0) for (float& c : centroid) c = rng.uniform();
    for (float c : centroid) *out++ = c + 0.5f * rng.uniform();
  }
  return k;
}

// The SmolLM2-shaped cache config, and a prefill cache holding one kPrompt-token sequence (id 1)
// with its admission message (the remote fields left to the exporter).
CacheConfig smol_config(int budget_tokens, double fetch_ratio) {
  CacheConfig c;
  c.shape = ModelShape{kLayers, kQHeads, kHeads, kDim};
  c.block_tokens = kBlockTokens;
  c.budget_tokens = budget_tokens;
  c.fetch_ratio = fetch_ratio;
  c.max_tokens_per_sequence = kPrompt + 1024;
  return c;
}

struct Prompt {
  std::unique_ptr<Cache<cpu, float>> cache;
  AdmissionMessage message;
  std::vector<float> queries;  // the lookahead queries of the message: [layer][q heads][dim]
};

Prompt make_prompt(const CacheConfig& config, Random& rng) {
  Prompt p{std::make_unique<Cache<cpu, float>>(config), {}, {}};
  const CacheLayout& L = p.cache->layout();
  const SeqId id = 1;
  p.cache->add_sequence(id);
  const std::int32_t rows[] = {static_cast<std::int32_t>(kPrompt)};
  std::vector<float> v(static_cast<std::size_t>(kPrompt * L.row_elems));
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<float> k = structured_keys(rng, kPrompt);
    for (float& x : v) x = rng.uniform();
    p.cache->append(std::span(&id, 1), l, rows, rows_view(k.data(), kPrompt), rows_view(v.data(), kPrompt));
  }
  p.queries.resize(static_cast<std::size_t>(kLayers * L.q_row_elems));
  for (float& x : p.queries) x = rng.uniform();
  p.message = make_admission(*p.cache, id, p.queries, 1);
  return p;
}

// A PrefillServer on its own thread, progressing (over tcp it serves our gets), exporting one
// request of kPoolBlocks pool blocks; the decode side's connection and source of that request.
struct Remote {
  std::atomic<bool> stop{false}, busy{false};
  std::thread server;
  std::shared_ptr<ucx::PrefillConnection> connection;
  std::shared_ptr<RemoteBlockSource> source;
  AdmissionMessage message;

  Remote() {
    transport();
    std::promise<std::uint16_t> port;
    auto listening = port.get_future();
    server = std::thread([this, port = std::move(port)]() mutable {
      pin(::pthread_self(), cpu_of(1));
      std::optional<ucx::PrefillServer> s;
      try {
        s.emplace("127.0.0.1", 0);
        Random rng(5);
        Prompt prompt = make_prompt(smol_config(2048, 1.0), rng);
        AdmissionMessage& m = prompt.message;
        s->export_request(host_blocks_of(*prompt.cache, 1), kPoolBlock, m);
        prompt.cache.reset();  // exported: the server holds its own copy
        port.set_value(s->port());
        std::vector<std::uint64_t> peers;
        while (peers.empty() && !stop) peers = s->progress(std::chrono::milliseconds(1));
        if (!stop) s->send_admission(peers.front(), m);
      } catch (...) {
        try { port.set_exception(std::current_exception()); } catch (...) {}  // already set: ours fails
      }
      // Spins while a benchmark reads; otherwise idles, so that later benchmarks keep the CPUs.
      while (s && !stop) {
        s->progress();
        if (!busy) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
    try {
      const std::uint16_t p = listening.get();
      connection = ucx::PrefillConnection::connect("127.0.0.1", p, std::chrono::seconds(10), std::chrono::seconds(10));
      message = decode_admission(connection->receive_admission(std::chrono::seconds(30)));
      source = connection->source(message);
    } catch (...) {
      stop = true;
      server.join();
      throw;
    }
  }
  ~Remote() {
    source.reset();  // releases the request while the server still progresses
    connection.reset();
    stop = true;
    server.join();
  }
};

Remote& remote() {
  static Remote r;  // torn down at exit
  return r;
}

void BM_RemoteGather(benchmark::State& state) {
  const auto batch = static_cast<std::size_t>(state.range(0));
  const double peer_rate = peer().get8k.at(static_cast<int>(batch));
  const double peer_large = peer().get64k;
  Remote* r = nullptr;
  try {
    r = &remote();
  } catch (const std::exception& e) {
    state.SkipWithError((std::string("remote tier setup failed: ") + e.what()).c_str());
    return;
  }
  // Destinations: distinct slots, as a plan's copies write distinct device-tier slots.
  std::vector<std::byte> local(batch * kHeadBlock);
  constexpr int kPlans = 32;
  std::vector<std::vector<RemoteBlockRead>> plans(kPlans);
  Random rng(static_cast<std::uint64_t>(batch));
  for (auto& plan : plans) {
    for (std::size_t i = 0; i < batch; ++i) {
      const std::uint64_t b = rng.next() % kPoolBlocks, lh = rng.next() % (kLayers * kHeads);
      plan.push_back({local.data() + i * kHeadBlock, r->message.block_addresses[b] + lh * kHeadBlock, kHeadBlock});
    }
  }
  pin(::pthread_self(), cpu_of(0));  // undone below
  r->busy = true;
  std::size_t i = 0;
  const auto start = std::chrono::steady_clock::now();
  try {
    for (auto _ : state) {
      r->source->read(plans[i++ % kPlans]);
      benchmark::ClobberMemory();
    }
  } catch (const std::exception& e) {
    r->busy = false;
    pin(::pthread_self(), -1);
    state.SkipWithError(e.what());
    return;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r->busy = false;
  pin(::pthread_self(), -1);
  const double bytes = static_cast<double>(state.iterations()) * static_cast<double>(batch * kHeadBlock);
  const double rate = bytes / seconds;  // timed here: a ratio needs the same clock as its rate
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  state.counters["GBps"] = rate / 1e9;
  state.counters["perftest_get_GBps"] = peer_rate / 1e9;
  state.counters["of_perftest_get"] = peer_rate > 0 ? rate / peer_rate : 0.0;
  state.counters["perftest_get64K_GBps"] = peer_large / 1e9;
  state.counters["of_perftest_get64K"] = peer_large > 0 ? rate / peer_large : 0.0;
  state.SetLabel("UCX_TLS=" + transport() + ", peer: ucx_perftest ucp_get 8 KiB x " + std::to_string(batch) +
                 " outstanding" + (peer_rate > 0 ? "" : " (NOT MEASURED: ucx_perftest missing or failed; ratio 0)"));
}

void register_gather(benchmark::internal::Benchmark* b) {
  for (int batch : kBatches) b->Arg(batch);
}
BENCHMARK(BM_RemoteGather)->Apply(register_gather)->ArgName("blocks")->UseRealTime();

// A RemoteBlockSource over plain memory that counts what the cache reads through it.
class CountingSource final : public RemoteBlockSource {
 public:
  std::vector<std::byte> region;
  std::atomic<std::uint64_t> bytes{0}, blocks{0};
  void read(std::span<const RemoteBlockRead> reads) override {
    for (const RemoteBlockRead& r : reads) {
      std::memcpy(r.local, reinterpret_cast<const void*>(r.remote), r.bytes);
      bytes += r.bytes;
    }
    blocks += reads.size();
  }
};

// Queries drift as an AR(1) walk, q <- a q + sqrt(1 - a^2) noise (correlation a from one step to
// the next; a = q_persist_pct / 100): how fast selections change is what the fetch cap meets.
void BM_RemoteBytesPerStep(benchmark::State& state) {
  const CacheConfig config = smol_config(static_cast<int>(state.range(0)), static_cast<double>(state.range(1)) / 100.0);
  const float persistence = static_cast<float>(state.range(2)) / 100.0f;
  Random rng(11);
  Prompt prompt = make_prompt(config, rng);
  Cache<cpu, float> decode(config);
  const CacheLayout& L = decode.layout();
  const SeqId id = 1;
  AdmissionMessage& m = prompt.message;
  std::vector<float>& q = prompt.queries;
  // The "prefill side's" exported copy of the prompt's pool blocks.
  auto source = std::make_shared<CountingSource>();
  const auto blocks = host_blocks_of(*prompt.cache, id);
  source->region.resize(blocks.size() * kPoolBlock);
  m.region_base = reinterpret_cast<std::uint64_t>(source->region.data());
  m.region_bytes = source->region.size();
  m.packed_rkey.assign(4, std::byte{1});
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    std::memcpy(source->region.data() + b * kPoolBlock, blocks[b], kPoolBlock);
    m.block_addresses.push_back(m.region_base + b * kPoolBlock);
  }
  prompt.cache.reset();
  std::vector<Ticket> tickets = decode.admit(id, m, source);
  const std::uint64_t bytes0 = source->bytes, blocks0 = source->blocks;

  const float noise = std::sqrt(1.0f - persistence * persistence);
  std::vector<float> row(static_cast<std::size_t>(L.row_elems));
  std::int64_t steps = 0;
  for (auto _ : state) {
    for (int l = 0; l < kLayers; ++l) {
      for (float& x : row) x = rng.uniform();
      decode.append(std::span(&id, 1), l, rows_view(row.data(), 1), rows_view(row.data(), 1));
      float* ql = q.data() + static_cast<std::size_t>(l) * static_cast<std::size_t>(L.q_row_elems);
      for (int j = 0; j < L.q_row_elems; ++j) ql[j] = persistence * ql[j] + noise * rng.uniform();
      const Ticket next = decode.prefetch(std::span(&id, 1), l, rows_view(ql, 1));
      (void)decode.acquire(tickets[static_cast<std::size_t>(l)]);
      decode.release(tickets[static_cast<std::size_t>(l)]);
      tickets[static_cast<std::size_t>(l)] = next;
    }
    ++steps;
  }
  for (const Ticket& t : tickets) {  // the last plans' reads land too
    (void)decode.acquire(t);
    decode.release(t);
  }
  const double s = static_cast<double>(steps);
  const double read_bytes = static_cast<double>(source->bytes - bytes0);
  const double full_kv = static_cast<double>(kPoolBlocks) * static_cast<double>(kPoolBlock);
  state.counters["bytes_per_step"] = read_bytes / s;
  state.counters["blocks_per_step"] = static_cast<double>(source->blocks - blocks0) / s;
  state.counters["blocks_per_layer_head"] = static_cast<double>(source->blocks - blocks0) / s / (kLayers * kHeads);
  // Selectable blocks per (layer, kv head), and the fetch cap on admits per step (config.hpp).
  const double budget_blocks = config.budget_tokens / kBlockTokens;
  state.counters["cap_per_layer_head"] = config.fetch_ratio >= 1.0 ? budget_blocks
                                             : std::max(1.0, std::floor(config.fetch_ratio * budget_blocks));
  state.counters["of_full_prompt_kv"] = read_bytes / s / full_kv;  // 1.0: the whole prompt's KV every step
  state.counters["admission_working_set_MiB"] = static_cast<double>(m.working_set_rows.size()) / (1 << 20);
  state.SetLabel("SmolLM2-135M shape, 4,096-token prompt, in-memory source");
}
BENCHMARK(BM_RemoteBytesPerStep)
    ->ArgNames({"budget", "fetch_pct", "q_persist_pct"})
    ->ArgsProduct({{256, 2048}, {100, 5}, {90, 99}})
    ->Iterations(64)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace oasiskv::bench
