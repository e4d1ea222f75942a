// For safetensors_interop.py: `write FILE` writes tensors of every dtype and a model-only
// checkpoint's names; `check FILE` reads the file Python wrote and checks its values.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/io/safetensors.hpp"

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  const std::string mode = argv[1], path = argv[2];
  try {
    if (mode == "write") {
      tandem::SafetensorsWriter out;
      out.add("f64", std::vector<double>{1.5, -2.25})
          .add("f32", std::vector<float>{0.5f, 1.0f, 2.0f, 4.0f, 8.0f, 16.0f}, {2, 3})
          .add("f16", std::vector<tandem::half>{tandem::half(1.5f), tandem::half(-3.0f)})
          .add("i64", std::vector<std::int64_t>{-5, 1ll << 40})
          .add("i32", std::vector<std::int32_t>{7})
          .add("u8", std::vector<std::uint8_t>{0, 200})
          .metadata("format", "pt")
          .checksum();
      out.write(path);
      tandem::SafetensorsWriter brain;  // numpy has no bfloat16: torch reads this one
      brain.add("bf16",
                std::vector<tandem::bfloat16>{tandem::bfloat16(2.5f), tandem::bfloat16(-0.75f)});
      brain.write(path + ".bf16");
      return 0;
    }
    if (mode == "model") {  // a model-only checkpoint: what torch's load_state_dict takes as is
      tandem::run_local(1, [&](tandem::LocalComm& comm) {
        tandem::Parameters<float> params;
        params.add("fc.weight", {4, 3});
        params.add("fc.bias", {4});
        params.finalize();
        auto v = params.values();
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>(i);
        tandem::TrainingState state;
        state.model(params);
        tandem::save_checkpoint(comm, path, state);
      });
      return 0;
    }
    if (mode == "check") {
      const auto file = tandem::SafetensorsFile::open(path);
      const auto a = file.values<float>("a");
      const auto b = file.values<std::int64_t>("b");
      const bool ok = file.entry("a").shape == std::vector<std::int64_t>{2, 2} &&
                      a == std::vector<float>{1, 2, 3, 4.5f} &&
                      b == std::vector<std::int64_t>{-1, 9} &&
                      file.metadata().at("who") == "python";
      std::printf("%s\n", ok ? "tandem read Python's file" : "MISMATCH");
      return ok ? 0 : 1;
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 1;
  }
  return 2;
}
