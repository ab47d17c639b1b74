// The remainder stores' memory: capacity reserved and committed as rows arrive, and a capacity
// the machine cannot reserve refused with an Error naming the bytes.
#include <cstdio>
#include <string>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "reference_remainder.hpp"
#include "support.hpp"

using namespace oasiskv;
using namespace oasiskv::test;

namespace {
// Resident memory of this process, in bytes (Linux: /proc/self/statm).
std::int64_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  REQUIRE(f != nullptr);
  long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  REQUIRE(n == 2);
  return static_cast<std::int64_t>(resident) * 4096;
}
}  // namespace

TEST_CASE("clusters and quantized reserve their capacity: memory is committed as rows arrive, not at construction") {
  // 32 layers x 8 kv heads x 16K tokens x 8 sequences (head dim 128): the cluster arrays are
  // about 2.3 GiB and the 4-bit codes about 4.5 GiB of address space.
  CacheConfig c;
  c.shape = ModelShape{32, 32, 8, 128};
  c.max_sequences = 8;
  c.max_tokens_per_sequence = 16384;
  for (const RemainderEstimate r : {RemainderEstimate::clusters, RemainderEstimate::quantized}) {
    CAPTURE(remainder_name(r));
    c.remainder = r;
    const std::int64_t before = resident_bytes();
    Cache<cpu, fp16_t> cache(c);
    const std::int64_t grown = resident_bytes() - before;
    CHECK(grown < (std::int64_t{128} << 20));  // under 128 MiB committed by an empty cache
    // Rows arrive: the blocks they fill take memory, and the store works (a segment is clustered).
    cache.add_sequence(1);
    std::mt19937_64 rng(1);
    const auto rows = test::random_rows<fp16_t>(rng, std::size_t{1024} * 8 * 128);
    cache.append(std::vector<SeqId>{1}, 0, std::vector<std::int32_t>{1024}, RowsView{rows.data(), DType::f16, 1024},
                 RowsView{rows.data(), DType::f16, 1024});
    if (r == RemainderEstimate::clusters) CHECK(clusters_of(cache).key_clusters().clustered(0, 0, 0, 0));
  }
}

TEST_CASE("a capacity the machine cannot reserve is an Error naming the bytes, never std::bad_alloc") {
  // The reservations themselves: an overflowing count and one past any address space.
  CHECK_THROWS_WITH_AS((ReservedArray<float>(INT64_MAX / 2, "test array")), doctest::Contains("test array"), Error);
  CHECK_THROWS_WITH_AS((ReservedArray<float>(std::int64_t{1} << 60, "test array")),
                       doctest::Contains("test array: cannot reserve 4611686018427387904 bytes"), Error);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  MESSAGE("skipped the address-space limit: the sanitizers' own mappings need it");
#else
  // A cache whose host tier, slots and summaries fit the address space left (about 46 GiB
  // reserved) and whose remainder store (about 10 GiB more) does not: in a child process with
  // RLIMIT_AS 48 GiB above what it maps now, the constructor must throw an Error naming the bytes.
  CacheConfig c;
  c.shape = ModelShape{4, 4, 4, 128};
  c.max_sequences = 16;
  c.max_tokens_per_sequence = 163840;  // 40 GiB of float host tier
  c.remainder_cluster_rows = 4;        // 256 clusters a segment: sums are a quarter of the rows
  c.remainder_bits = 8;
  for (const RemainderEstimate r : {RemainderEstimate::clusters, RemainderEstimate::quantized}) {
    CAPTURE(remainder_name(r));
    c.remainder = r;
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      std::FILE* f = std::fopen("/proc/self/statm", "r");
      long long pages = 0;
      if (f == nullptr || std::fscanf(f, "%lld", &pages) != 1) ::_exit(3);
      std::fclose(f);
      const rlim_t limit = static_cast<rlim_t>(pages) * 4096 + (rlim_t{48} << 30);
      const rlimit rl{limit, limit};
      if (::setrlimit(RLIMIT_AS, &rl) != 0) ::_exit(3);
      try {
        Cache<cpu, float> cache(c);
        ::_exit(4);  // it fit after all: the test's sizes are wrong
      } catch (const Error& e) {
        ::_exit(std::string(e.what()).find("cannot reserve") != std::string::npos ? 0 : 2);
      } catch (const std::bad_alloc&) {
        ::_exit(1);
      } catch (...) {
        ::_exit(2);
      }
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);  // 1: std::bad_alloc, 2: another error, 4: no error
  }
#endif
}
