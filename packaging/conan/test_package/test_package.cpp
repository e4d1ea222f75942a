// The package's smoke test: four LocalComm ranks sum their rank numbers; with the gloo option, a
// one-rank Gloo group averages a vector as well; with the io option, a safetensors file is written
// and read back in memory. Exits non-zero when a result is wrong.
#include <tandem/tandem.hpp>
#if defined(TEST_GLOO)
#include <tandem/comm/gloo/gloo.hpp>
#include <tandem/rendezvous/store.hpp>
#endif
#if defined(TEST_IO)
#include <tandem/io/safetensors.hpp>
#endif

#include <atomic>
#include <chrono>
#include <cstdio>
#include <vector>

int main() {
  std::atomic<int> wrong{0};
  tandem::run_local(4, [&](tandem::LocalComm& comm) {
    std::vector<float> values(8, static_cast<float>(comm.rank()));
    comm.all_reduce(values, tandem::ReduceOp::sum);
    for (float v : values) {
      if (v != 6.0f) ++wrong;  // 0 + 1 + 2 + 3
    }
  });
  std::printf("tandem %d.%d.%d: LocalComm all_reduce over 4 ranks %s\n", TANDEM_VERSION_MAJOR,
              TANDEM_VERSION_MINOR, TANDEM_VERSION_PATCH, wrong == 0 ? "ok" : "WRONG");
#if defined(TEST_GLOO)
  tandem::HashStore store(std::chrono::seconds(30));
  tandem::AnyStore any(store);
  auto gloo = tandem::GlooComm::rendezvous(tandem::World::single_node(0, 1), any);
  std::vector<float> values(8, 3.0f);
  gloo.all_reduce(values, tandem::ReduceOp::avg);
  const bool gloo_ok = gloo.size() == 1 && values[7] == 3.0f;
  std::printf("tandem: GlooComm all_reduce over 1 rank %s\n", gloo_ok ? "ok" : "WRONG");
  if (!gloo_ok) ++wrong;
#endif
#if defined(TEST_IO)
  tandem::SafetensorsWriter writer;
  writer.add("w", std::vector<float>{1.5f, -2.0f}).checksum();
  const auto bytes = writer.serialize();
  const auto file = tandem::SafetensorsFile::parse(bytes, "memory");
  file.verify_checksum();
  const bool io_ok = file.values<float>("w") == std::vector<float>{1.5f, -2.0f};
  std::printf("tandem: safetensors round trip %s\n", io_ok ? "ok" : "WRONG");
  if (!io_ok) ++wrong;
#endif
#if defined(TEST_TORCH)
  std::printf("tandem: the torch component found and linked\n");
#endif
  return wrong == 0 ? 0 : 1;
}
