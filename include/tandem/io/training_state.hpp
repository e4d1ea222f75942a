// tandem/io/training_state.hpp - TrainingState: the parts of a training run a checkpoint holds
// (parameters and buffers under the model's own names, optimizer moments under PyTorch's names,
// GradScaler, EMA shadow, LR schedule, sampler epoch and position, counters, every rank's RNG),
// registered by reference, saved into a SafetensorsWriter and restored from a SafetensorsFile.
// Loading never trusts the file: every value is checked against its type's range and what it
// restores (shapes against the arena, the sampler's position against its epoch, the GradScaler's
// factors), and a violation is an Error naming the file and the field.
//   tandem::TrainingState state;
//   state.model(params).optimizer(opt).scaler(scaler).ema(ema, params).scheduler(schedule)
//        .sampler(sampler, batches_done).counter("step", step).rng("dropout", generator);
// Needs: nlohmann-json (the tandem::io CMake component). checkpoint.hpp saves and loads it.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/metrics.hpp"
#include "tandem/core/error.hpp"
#include "tandem/io/safetensors.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// What a checkpoint needs of the job: this rank, the rank count, and every rank's bytes.
/// Made by save_checkpoint/load_checkpoint from the communicator; parts of a TrainingState that
/// differ per rank (random generators) use it.
struct CheckpointRanks {
  int rank = 0;  ///< this rank
  int size = 1;  ///< the rank count
  /// Every rank's `mine`, in rank order (a collective: every rank calls it).
  std::function<std::vector<std::string>(const std::string& mine)> gather;
};

namespace detail {
template <Communicator Comm>
CheckpointRanks checkpoint_ranks(Comm& comm) {
  return {
      comm.rank(), comm.size(), [&comm](const std::string& mine) {
        const std::vector<std::uint8_t> bytes(mine.begin(), mine.end());
        std::vector<std::string> out;
        for (const auto& part : all_gather_per_rank(comm, std::span<const std::uint8_t>(bytes))) {
          out.emplace_back(part.begin(), part.end());
        }
        return out;
      }};
}

// An integer field of the metadata, as type I: a JSON integer in I's range, else an Error naming
// the field (nlohmann's get<I> would cast a float, with undefined behaviour out of range, and
// wrap a negative number into an unsigned type).
template <class I>
requires std::is_integral_v<I> I json_integer(const nlohmann::json& value, std::string_view what) {
  if (value.is_number_unsigned()) {
    const auto v = value.template get<std::uint64_t>();
    if (std::in_range<I>(v)) return static_cast<I>(v);
  } else if (value.is_number_integer()) {
    const auto v = value.template get<std::int64_t>();
    if (std::in_range<I>(v)) return static_cast<I>(v);
  } else {
    throw Error("load_checkpoint",
                "'" + std::string(what) + "' is " + value.dump() + ", not an integer");
  }
  throw Error("load_checkpoint",
              "'" + std::string(what) + "' is " + value.dump() + ", out of range for its type");
}

// A list of integers of the metadata (see json_integer).
template <class I>
std::vector<I> json_integers(const nlohmann::json& value, std::string_view what) {
  if (!value.is_array()) {
    throw Error("load_checkpoint", "'" + std::string(what) + "' is not a list of integers");
  }
  std::vector<I> out;
  out.reserve(value.size());
  for (const auto& item : value) out.push_back(json_integer<I>(item, what));
  return out;
}

// A whole decimal number of the text `digits` (no sign, no spaces, nothing after it) that fits
// I; nullopt otherwise.
template <class I>
std::optional<I> whole_number(std::string_view digits) {
  I value{};
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || digits.front() == '-' || error != std::errc() ||
      end != digits.data() + digits.size()) {
    return std::nullopt;
  }
  return value;
}

// A number field of the metadata: a JSON number, finite (nlohmann's get<double> would take
// `true` as 1), else an Error naming the field.
inline double json_number(const nlohmann::json& value, std::string_view what) {
  if (!value.is_number() || !std::isfinite(value.get<double>())) {
    throw Error("load_checkpoint",
                "'" + std::string(what) + "' is " + value.dump() + ", not a finite number");
  }
  return value.get<double>();
}

// A list of numbers of the metadata (see json_number).
inline std::vector<double> json_number_list(const nlohmann::json& value, std::string_view what) {
  if (!value.is_array()) {
    throw Error("load_checkpoint", "'" + std::string(what) + "' is not a list of numbers");
  }
  std::vector<double> out;
  for (const auto& item : value) out.push_back(json_number(item, what));
  return out;
}

// An object of named numbers of the metadata (optimizer options, GradScaler state; see
// json_number).
inline std::map<std::string, double> json_number_map(const nlohmann::json& value,
                                                     std::string_view what) {
  if (!value.is_object()) {
    throw Error("load_checkpoint", "'" + std::string(what) + "' is not an object of numbers");
  }
  std::map<std::string, double> out;
  for (const auto& [key, item] : value.items()) {
    out[key] = json_number(item, std::string(what) + "." + key);
  }
  return out;
}

// What a GradScaler's state must hold to be restored: positive finite scale, growth factor above
// 1, backoff factor in (0, 1), a positive whole growth interval and a whole non-negative tracker
// (GradScaler converts the last two to integers, undefined behaviour out of their range).
inline void check_scaler_state(const std::map<std::string, double>& state, const std::string& key) {
  auto check = [&](const char* name, bool ok, const char* must) {
    const auto found = state.find(name);
    if (found == state.end() || ok) return;
    throw Error("load_checkpoint", "'" + key + "." + name + "' is " +
                                       nlohmann::json(found->second).dump() + "; it must be " +
                                       must);
  };
  auto value = [&](const char* name) {
    const auto found = state.find(name);
    return found == state.end() ? 1.5 : found->second;
  };
  auto whole = [](double v, double high) { return v == std::floor(v) && v >= 0 && v <= high; };
  check("scale", value("scale") > 0, "positive");
  check("growth_factor", value("growth_factor") > 1, "above 1");
  check("backoff_factor", value("backoff_factor") > 0 && value("backoff_factor") < 1,
        "between 0 and 1");
  check("growth_interval", whole(value("growth_interval"), 1e18) && value("growth_interval") >= 1,
        "a whole number of at least 1");
  check("_growth_tracker",
        whole(value("_growth_tracker"), std::numeric_limits<std::int32_t>::max()),
        "a whole number from 0 to 2^31 - 1");
}

// The shape a tensor of `shape` is stored under: the same, or [numel] for a 0-d one (what
// SafetensorsWriter::add makes of an empty shape).
template <class Shape>
std::vector<std::int64_t> stored_shape(const Shape& shape, std::size_t numel) {
  std::vector<std::int64_t> out(shape.begin(), shape.end());
  if (out.empty()) out.push_back(static_cast<std::int64_t>(numel));
  return out;
}

inline std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Reads tensor `name` of `in` into `out`, whose shape must be the file's (read_into checks the
// dtype and the element count; a transposed [3, 4] for a [4, 3] parameter has the right count).
template <class Out, class Shape>
void read_shaped(const SafetensorsFile& in, const std::string& name, Out&& out,
                 const Shape& shape) {
  const auto expected = stored_shape(shape, std::ranges::size(out));
  const auto& entry = in.entry(name);
  if (entry.shape != expected &&
      !(expected.size() == 1 && entry.shape.empty() && expected[0] == 1)) {
    throw Error("load_checkpoint " + in.name(), "tensor '" + name + "' has the shape " +
                                                    shape_text(entry.shape) + " in the file and " +
                                                    shape_text(expected) + " in the model");
  }
  in.read_into(name, std::forward<Out>(out));
}

// A name in the file for `name`: the same, or the same with or without "module." (what
// DistributedDataParallel adds in PyTorch), whichever the file has.
inline std::string name_in_file(const SafetensorsFile& file, const std::string& name) {
  if (file.contains(name)) return name;
  constexpr std::string_view module = "module.";
  if (name.starts_with(module) && file.contains(name.substr(module.size()))) {
    return name.substr(module.size());
  }
  if (file.contains(std::string(module) + name)) return std::string(module) + name;
  return name;  // entry() names it in its error
}
}  // namespace detail

/// What a checkpoint saves of a sampler and checks when it restores one: tandem::DistributedSampler
/// (data/sampler.hpp) models it. The epoch and the batches consumed are restored; the data set
/// size, the rank count and the options must be the ones it was saved with.
template <class S>
concept ResumableSampler = requires(S& sampler, const S& seen, std::uint64_t epoch) {
  { seen.epoch() } -> std::convertible_to<std::uint64_t>;
  sampler.set_epoch(epoch);
  { seen.size() } -> std::convertible_to<std::size_t>;  // this rank's samples an epoch
  { seen.dataset_size() } -> std::convertible_to<std::size_t>;
  { seen.num_replicas() } -> std::convertible_to<int>;
  { seen.rank() } -> std::convertible_to<int>;
  { seen.options().seed } -> std::convertible_to<std::uint64_t>;
  { seen.options().shuffle } -> std::convertible_to<bool>;
  { seen.options().drop_last } -> std::convertible_to<bool>;
};

/// The parts of a training run a checkpoint holds, registered by reference: the objects must
/// outlive the TrainingState. Saving reads them; loading writes into them. Each part has a key;
/// tensors are stored under the model's own names (parameters, buffers) or `key.` prefixed
/// (optimizer moments as `optimizer.state.<i>.exp_avg`, the EMA shadow as `ema.<name>`), the
/// rest as JSON in the `tandem.state` metadata entry.
class TrainingState {
 public:
  /// The metadata entry holding the non-tensor state.
  static constexpr const char* metadata_key = "tandem.state";

  /// Parameters and buffers of a Parameters arena under their names, with `prefix` before each
  /// ("module." gives the names a DDP-wrapped PyTorch module has). Loading accepts files saved
  /// with or without "module.".
  template <class Params>
  TrainingState& model(Params& params, std::string prefix = "") {
    parts_.push_back(
        {[&params, prefix](SafetensorsWriter& out, nlohmann::json&, const CheckpointRanks&) {
           for (auto& p : params) out.add(prefix + p.name(), p.value(), shape_of(p.shape()));
           for (auto& b : params.buffers())
             out.add(prefix + b.name(), b.value(), shape_of(b.shape()));
         },
         [&params, prefix](const SafetensorsFile& in, const nlohmann::json&,
                           const CheckpointRanks&) {
           for (auto& p : params) {
             detail::read_shaped(in, detail::name_in_file(in, prefix + p.name()), p.value(),
                                 p.shape());
           }
           for (auto& b : params.buffers()) {
             detail::read_shaped(in, detail::name_in_file(in, prefix + b.name()), b.value(),
                                 b.shape());
           }
         }});
    return *this;
  }

  /// An optimizer's state_dict(): moments as tensors under PyTorch's names, step counts and
  /// param groups as JSON. A ZeRO-sharded optimizer (DistributedDataParallel::shard) is saved
  /// consolidated, in the same layout as a full one: every rank takes part in gathering its
  /// state; loading gives each rank the full state, of which a sharded optimizer keeps its part,
  /// so the file loads at any world size, with or without sharding.
  template <class Optimizer>
  TrainingState& optimizer(Optimizer& opt, std::string key = "optimizer") {
    parts_.push_back(
        {[&opt, key](SafetensorsWriter& out, nlohmann::json& meta, const CheckpointRanks& ranks) {
           bool sharded = false;
           if constexpr (requires { opt.sharded(); }) sharded = opt.sharded();
           if (ranks.rank != 0 && !sharded) return;
           const auto dict = opt.state_dict();  // a collective when sharded
           if (ranks.rank != 0) return;
           nlohmann::json state = nlohmann::json::object();
           for (const auto& [index, param] : dict.state) {
             nlohmann::json entry{{"scalars", param.scalars}, {"tensors", nlohmann::json::array()}};
             for (const auto& [name, tensor] : param.tensors) {
               out.add(key + ".state." + std::to_string(index) + "." + name, tensor);
               entry["tensors"].push_back(name);
             }
             state[std::to_string(index)] = std::move(entry);
           }
           nlohmann::json groups = nlohmann::json::array();
           for (const auto& group : dict.param_groups) {
             groups.push_back(
                 {{"options", group.options}, {"params", group.params}, {"step", group.step}});
           }
           meta[key] = {{"state", std::move(state)}, {"param_groups", std::move(groups)}};
         },
         [&opt, key](const SafetensorsFile& in, const nlohmann::json& meta,
                     const CheckpointRanks&) {
           using Dict = decltype(opt.state_dict());
           using TensorBuffer = typename decltype(Dict{}.state[0].tensors)::mapped_type;
           const auto& saved = required(meta, key);
           Dict dict;
           for (const auto& [index, entry] : saved.at("state").items()) {
             const auto slot = detail::whole_number<std::size_t>(index);
             if (!slot) {
               throw Error("load_checkpoint " + in.name(), "'" + key + ".state' has an entry '" +
                                                               index +
                                                               "', which is not a parameter index");
             }
             auto& param = dict.state[*slot];
             param.scalars = detail::json_number_map(entry.at("scalars"), key + ".state.scalars");
             for (const auto& name : entry.at("tensors")) {
               const std::string tensor =
                   key + ".state." + index + "." + name.template get<std::string>();
               TensorBuffer buffer(in.entry(tensor).numel());
               in.read_into(tensor, buffer);
               param.tensors.emplace(name.template get<std::string>(), std::move(buffer));
             }
           }
           for (const auto& group : saved.at("param_groups")) {
             typename Dict::GroupState g;
             g.options =
                 detail::json_number_map(group.at("options"), key + ".param_groups.options");
             g.params = detail::json_integers<std::size_t>(group.at("params"),
                                                           key + ".param_groups.params");
             g.step =
                 detail::json_integer<std::int64_t>(group.at("step"), key + ".param_groups.step");
             dict.param_groups.push_back(std::move(g));
           }
           opt.load_state_dict(dict);
         },
         true});  // collective for sharded optimizers (the others return on ranks but 0)
    return *this;
  }

  /// A GradScaler's state_dict() (PyTorch's keys).
  template <class Scaler>
  TrainingState& scaler(Scaler& scaler, std::string key = "grad_scaler") {
    parts_.push_back({[&scaler, key](SafetensorsWriter&, nlohmann::json& meta,
                                     const CheckpointRanks&) { meta[key] = scaler.state_dict(); },
                      [&scaler, key](const SafetensorsFile&, const nlohmann::json& meta,
                                     const CheckpointRanks&) {
                        const auto saved = detail::json_number_map(required(meta, key), key);
                        detail::check_scaler_state(saved, key);
                        scaler.load_state_dict(saved);
                      }});
    return *this;
  }

  /// An EMA's shadow under `key.NAME` for each parameter and buffer of `params` (the arena
  /// the EMA averages), and its update count.
  template <class Ema, class Params>
  TrainingState& ema(Ema& ema, Params& params, std::string key = "ema") {
    parts_.push_back(
        {[&ema, &params, key](SafetensorsWriter& out, nlohmann::json& meta,
                              const CheckpointRanks&) {
           for_each_shadow(ema, params, key, [&](const std::string& name, auto view, auto shape) {
             out.add(name, view, shape_of(shape));
           });
           meta[key] = {{"updates", ema.updates()}};
         },
         [&ema, &params, key](const SafetensorsFile& in, const nlohmann::json& meta,
                              const CheckpointRanks&) {
           const auto updates = detail::json_integer<std::size_t>(required(meta, key).at("updates"),
                                                                  key + ".updates");
           for_each_shadow(ema, params, key, [&](const std::string& name, auto view, auto shape) {
             detail::read_shaped(in, name, view, shape);
           });
           ema.set_updates(updates);
         }});
    return *this;
  }

  /// An LR scheduler's state_dict() (last_epoch, _step_count, base_lrs, _last_lr).
  template <class Scheduler>
  TrainingState& scheduler(Scheduler& schedule, std::string key = "lr_scheduler") {
    parts_.push_back(
        {[&schedule, key](SafetensorsWriter&, nlohmann::json& meta, const CheckpointRanks&) {
           const auto s = schedule.state_dict();
           meta[key] = {{"last_epoch", s.last_epoch},
                        {"_step_count", s.step_count},
                        {"base_lrs", s.base_lrs},
                        {"_last_lr", s.last_lr}};
         },
         [&schedule, key](const SafetensorsFile& in, const nlohmann::json& meta,
                          const CheckpointRanks&) {
           const auto& saved = required(meta, key);
           auto s = schedule.state_dict();
           s.last_epoch =
               detail::json_integer<std::int64_t>(saved.at("last_epoch"), key + ".last_epoch");
           s.step_count =
               detail::json_integer<std::int64_t>(saved.at("_step_count"), key + "._step_count");
           if (s.last_epoch < -1 || s.step_count < 0) {
             throw Error("load_checkpoint " + in.name(),
                         "'" + key + "' has last_epoch " + std::to_string(s.last_epoch) +
                             " and _step_count " + std::to_string(s.step_count) +
                             " (at least -1 and 0)");
           }
           s.base_lrs = detail::json_number_list(saved.at("base_lrs"), key + ".base_lrs");
           s.last_lr = detail::json_number_list(saved.at("_last_lr"), key + "._last_lr");
           schedule.load_state_dict(s);
         }});
    return *this;
  }

  /// A sampler's epoch (a DistributedSampler's, or any ResumableSampler's) and the batches of
  /// that epoch already consumed, so a resumed run starts at the next one. Loading checks the
  /// data set size and world size are the same.
  template <ResumableSampler Sampler>
  TrainingState& sampler(Sampler& sampler, std::size_t& batches_done, std::string key = "sampler") {
    parts_.push_back(
        {[&sampler, &batches_done, key](SafetensorsWriter&, nlohmann::json& meta,
                                        const CheckpointRanks&) {
           meta[key] = {{"epoch", sampler.epoch()},
                        {"batches_done", batches_done},
                        {"dataset_size", sampler.dataset_size()},
                        {"num_replicas", sampler.num_replicas()},
                        {"seed", sampler.options().seed},
                        {"shuffle", sampler.options().shuffle},
                        {"drop_last", sampler.options().drop_last}};
         },
         [&sampler, &batches_done, key](const SafetensorsFile& in, const nlohmann::json& meta,
                                        const CheckpointRanks&) {
           const auto& saved = required(meta, key);
           const auto size =
               detail::json_integer<std::size_t>(saved.at("dataset_size"), key + ".dataset_size");
           const auto replicas =
               detail::json_integer<int>(saved.at("num_replicas"), key + ".num_replicas");
           if (size != sampler.dataset_size() || replicas != sampler.num_replicas() ||
               detail::json_integer<std::uint64_t>(saved.at("seed"), key + ".seed") !=
                   sampler.options().seed) {
             throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                         "the sampler was saved for " + std::to_string(size) + " samples, " +
                             std::to_string(replicas) + " ranks and seed " +
                             saved.at("seed").dump() + "; this one has " +
                             std::to_string(sampler.dataset_size()) + ", " +
                             std::to_string(sampler.num_replicas()) + " and " +
                             std::to_string(sampler.options().seed));
           }
           const bool shuffle = saved.at("shuffle").template get<bool>();
           const bool drop_last = saved.at("drop_last").template get<bool>();
           if (shuffle != sampler.options().shuffle || drop_last != sampler.options().drop_last) {
             throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                         std::string("the sampler was saved with shuffle ") +
                             (shuffle ? "on" : "off") + " and drop_last " +
                             (drop_last ? "on" : "off") + "; this one has them " +
                             (sampler.options().shuffle ? "on" : "off") + " and " +
                             (sampler.options().drop_last ? "on" : "off"));
           }
           const auto epoch =
               detail::json_integer<std::uint64_t>(saved.at("epoch"), key + ".epoch");
           const auto done =
               detail::json_integer<std::size_t>(saved.at("batches_done"), key + ".batches_done");
           // A batch holds at least one sample: no epoch has more batches than this rank's samples.
           if (done > sampler.size()) {
             throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                         "'" + key + ".batches_done' is " + std::to_string(done) +
                             ", more batches than the epoch's " + std::to_string(sampler.size()) +
                             " samples on this rank");
           }
           sampler.set_epoch(epoch);
           batches_done = done;
         }});
    return *this;
  }

  /// A counter (the global step, say).
  template <class Integer>
  requires std::is_integral_v<Integer> TrainingState& counter(std::string key, Integer& value) {
    parts_.push_back(
        {[&value, key](SafetensorsWriter&, nlohmann::json& meta, const CheckpointRanks&) {
           meta[key] = value;
         },
         [&value, key](const SafetensorsFile&, const nlohmann::json& meta, const CheckpointRanks&) {
           value = detail::json_integer<Integer>(required(meta, key), key);
         }});
    return *this;
  }

  /// A random engine of the standard library's kind (state printable with <<, read with >>),
  /// one per rank: every rank's state is saved, and each rank gets its own back.
  template <class Engine>
  TrainingState& rng(std::string key, Engine& engine) {
    parts_.push_back(
        {[&engine, key](SafetensorsWriter&, nlohmann::json& meta, const CheckpointRanks& ranks) {
           std::ostringstream text;
           text << engine;
           meta[key] = ranks.gather(text.str());
         },
         [&engine, key](const SafetensorsFile& in, const nlohmann::json& meta,
                        const CheckpointRanks& ranks) {
           const auto& saved = required(meta, key);
           if (!saved.is_array() || saved.size() != static_cast<std::size_t>(ranks.size)) {
             throw Error(ranks.rank, "load_checkpoint " + in.name(),
                         "'" + key + "' holds " + std::to_string(saved.size()) +
                             " ranks' generators; this job has " + std::to_string(ranks.size));
           }
           const auto state_text =
               saved[static_cast<std::size_t>(ranks.rank)].template get<std::string>();
           std::istringstream text(state_text);
           Engine restored;
           text >> restored;
           // Printed back, a valid state is the text it was read from: that refuses trailing
           // garbage and words out of the engine's range, which >> would take and wrap.
           std::ostringstream again;
           again << restored;
           if (!text || again.str() != state_text) {
             throw Error(ranks.rank, "load_checkpoint " + in.name(),
                         "'" + key + "' of rank " + std::to_string(ranks.rank) +
                             " is not a generator's state");
           }
           engine = restored;
         },
         true});
    return *this;
  }

  /// Adds every part to `out` on rank 0, which writes the file; the other ranks take part only
  /// in the collective parts (random generators) and add nothing.
  void save_to(SafetensorsWriter& out, const CheckpointRanks& ranks) const {
    nlohmann::json meta = nlohmann::json::object();
    for (const auto& part : parts_) {
      if (part.collective || ranks.rank == 0) part.save(out, meta, ranks);
    }
    out.metadata(metadata_key, meta.dump());
  }

  /// Restores every part from `in`.
  void load_from(const SafetensorsFile& in, const CheckpointRanks& ranks) const {
    const auto entry = in.metadata().find(metadata_key);
    if (entry == in.metadata().end()) {
      throw Error(ranks.rank, "load_checkpoint " + in.name(),
                  "no training state (metadata '" + std::string(metadata_key) + "')");
    }
    nlohmann::json meta;
    try {
      meta = nlohmann::json::parse(entry->second);
    } catch (const nlohmann::json::exception& error) {
      throw Error(ranks.rank, "load_checkpoint " + in.name(),
                  std::string("the training state is not valid JSON: ") + error.what());
    }
    try {
      for (const auto& part : parts_) part.load(in, meta, ranks);
    } catch (const nlohmann::json::exception& error) {
      throw Error(
          ranks.rank, "load_checkpoint " + in.name(),
          std::string("the training state does not have the expected shape: ") + error.what());
    }
  }

 private:
  struct Part {
    std::function<void(SafetensorsWriter&, nlohmann::json&, const CheckpointRanks&)> save;
    std::function<void(const SafetensorsFile&, const nlohmann::json&, const CheckpointRanks&)> load;
    bool collective = false;  // its save gathers from every rank (the others read rank 0's only)
  };

  static const nlohmann::json& required(const nlohmann::json& meta, const std::string& key) {
    const auto found = meta.find(key);
    if (found == meta.end()) {
      throw Error("load_checkpoint", "the checkpoint has no '" + key + "' (saved without it?)");
    }
    return *found;
  }

  template <class Shape>
  static std::vector<std::int64_t> shape_of(const Shape& shape) {
    return std::vector<std::int64_t>(shape.begin(), shape.end());
  }

  template <class Ema, class Params, class F>
  static void for_each_shadow(Ema& ema, Params& params, const std::string& key, F&& f) {
    auto values = ema.shadow_values();
    auto buffers = ema.shadow_buffer_values();
    using ViewType = decltype(values);
    using T = typename ViewType::element_type;
    using Space = typename ViewType::memory_space;
    for (auto& p : params) {
      f(key + "." + p.name(), View<T, Space>(values.data() + p.offset(), p.shape()), p.shape());
    }
    for (auto& b : params.buffers()) {
      f(key + "." + b.name(), View<T, Space>(buffers.data() + b.offset(), b.shape()), b.shape());
    }
  }

  std::vector<Part> parts_;
};

}  // namespace tandem
