// What tests/elastic's workers (elastic_worker, heal_worker) share: the command line's
// "--flag value" pairs read into named words and numbers, and the synthetic samples their
// perceptron trains on, each a function of its index alone; an optimizer state's bytes.
//   if (!tandem::test::elastic::read_settings(argc, argv, words, numbers)) return usage();
//   auto batch = tandem::test::elastic::batch_of({sampler[0], sampler[1]});
// Needs: tests/fault/worker.hpp (read_flags) and tests/support/mlp.hpp (make_batch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "fault/worker.hpp"
#include "support/mlp.hpp"
#include "tandem/core/env.hpp"

namespace tandem::test::elastic {

/// Reads "--flag value" pairs: a flag of `words` takes its value as it is, one of `numbers` a
/// whole number in [-1, 10^7]. False for an unknown flag, a bad number or a flag left without its
/// value.
inline bool read_settings(int argc, char** argv,
                          const std::map<std::string_view, std::string*>& words,
                          const std::map<std::string_view, int*>& numbers) {
  return fault::read_flags(argc, argv, [&](std::string_view flag, const std::string& value) {
    if (const auto word = words.find(flag); word != words.end()) {
      *word->second = value;
      return true;
    }
    const auto number = numbers.find(flag);
    const auto parsed = tandem::parse_int(value);
    if (number == numbers.end() || !parsed || *parsed < -1 || *parsed > 10000000) return false;
    *number->second = static_cast<int>(*parsed);
    return true;
  });
}

/// An optimizer state_dict's bytes (each tensor in the dict's order, then each group's step
/// count), to compare two states bit for bit.
template <class Dict>
std::vector<std::byte> state_bytes(const Dict& dict) {
  std::vector<std::byte> out;
  const auto append = [&](const void* data, std::size_t size) {
    const auto* begin = static_cast<const std::byte*>(data);
    out.insert(out.end(), begin, begin + size);
  };
  for (const auto& [index, entry] : dict.state) {
    for (const auto& [key, tensor] : entry.tensors) {
      append(tensor.data(), tensor.size() * sizeof(*tensor.data()));
    }
  }
  for (const auto& group : dict.param_groups) append(&group.step, sizeof(group.step));
  return out;
}

/// Samples `indices` of the synthetic data set (8 inputs, 4 outputs; each sample a function of
/// its index alone, so that any split of the indices trains on the same samples).
inline Batch batch_of(const std::vector<std::int64_t>& indices) {
  Batch batch;
  batch.count = indices.size();
  for (const auto index : indices) {
    const auto one = make_batch(3, 0, static_cast<std::size_t>(index), 1, 8, 4);
    batch.x.insert(batch.x.end(), one.x.begin(), one.x.end());
    batch.y.insert(batch.y.end(), one.y.begin(), one.y.end());
  }
  return batch;
}

}  // namespace tandem::test::elastic
