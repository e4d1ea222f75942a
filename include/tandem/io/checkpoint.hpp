// tandem/io/checkpoint.hpp - the whole training state in one safetensors file: parameters and
// buffers under the model's own names, optimizer moments under PyTorch's names, GradScaler, EMA
// shadow, LR schedule, sampler epoch and position, counters and every rank's RNG. Saved by
// rank 0 atomically (then a barrier), loaded on every rank or broadcast from rank 0; the last K
// kept, the newest valid one found at start (a damaged file is reported and skipped; when every
// one is damaged, that is an Error rather than a silent start from scratch).
//   tandem::TrainingState state;
//   state.model(params).optimizer(opt).scaler(scaler).ema(ema, params).scheduler(schedule)
//        .sampler(sampler, batches_done).counter("step", step).rng("dropout", generator);
//   if (auto last = tandem::latest_checkpoint(dir)) tandem::load_checkpoint(comm, *last, state);
//   tandem::save_checkpoint(comm, dir, step, state);          // dir/checkpoint-<step>.safetensors
// Needs: nlohmann-json (the tandem::io CMake component) and a Communicator.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
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
#include "tandem/core/error.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/io/metrics.hpp"
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

// Every rank's `failure` (empty: none) decides together: an Error on every rank when any rank
// failed, with this rank's own cause where it has one.
template <Communicator Comm>
void agree_on_failure(Comm& comm, const std::string& failure, const std::string& operation,
                      const std::string& verb) {
  std::vector<std::int32_t> failed{failure.empty() ? 0 : 1};
  host_all_reduce(comm, std::span<std::int32_t>(failed), ReduceOp::max);
  if (failed[0] != 0) {
    throw Error(comm.rank(), operation,
                failure.empty() ? "another rank failed to " + verb : failure);
  }
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
           for (auto& p : params)
             in.read_into(detail::name_in_file(in, prefix + p.name()), p.value());
           for (auto& b : params.buffers()) {
             in.read_into(detail::name_in_file(in, prefix + b.name()), b.value());
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
             param.scalars = entry.at("scalars").template get<std::map<std::string, double>>();
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
             g.options = group.at("options").template get<std::map<std::string, double>>();
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
                        scaler.load_state_dict(
                            required(meta, key).template get<std::map<std::string, double>>());
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
           for_each_shadow(ema, params, key, [&](const std::string& name, auto view, auto) {
             in.read_into(name, view);
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
         [&schedule, key](const SafetensorsFile&, const nlohmann::json& meta,
                          const CheckpointRanks&) {
           const auto& saved = required(meta, key);
           auto s = schedule.state_dict();
           s.last_epoch =
               detail::json_integer<std::int64_t>(saved.at("last_epoch"), key + ".last_epoch");
           s.step_count =
               detail::json_integer<std::int64_t>(saved.at("_step_count"), key + "._step_count");
           s.base_lrs = saved.at("base_lrs").template get<std::vector<double>>();
           s.last_lr = saved.at("_last_lr").template get<std::vector<double>>();
           schedule.load_state_dict(s);
         }});
    return *this;
  }

  /// A DistributedSampler's epoch and the batches of that epoch already consumed, so a resumed
  /// run starts at the next one. Loading checks the data set size and world size are the same.
  TrainingState& sampler(DistributedSampler& sampler, std::size_t& batches_done,
                         std::string key = "sampler") {
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
           sampler.set_epoch(
               detail::json_integer<std::uint64_t>(saved.at("epoch"), key + ".epoch"));
           batches_done =
               detail::json_integer<std::size_t>(saved.at("batches_done"), key + ".batches_done");
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
           std::istringstream text(
               saved[static_cast<std::size_t>(ranks.rank)].template get<std::string>());
           text >> engine;
           if (!text)
             throw Error(ranks.rank, "load_checkpoint " + in.name(),
                         "'" + key + "' is not a generator's state");
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

/// Where and how checkpoints are kept.
struct CheckpointOptions {
  std::size_t keep_last = 3;           ///< older checkpoints are deleted after a save (0: keep all)
  std::string prefix = "checkpoint-";  ///< file names: prefix, the step in 12 digits, .safetensors
  bool broadcast = false;  ///< load: rank 0 reads and broadcasts (no shared file system)
};

/// The file of step `step` in `directory`.
[[nodiscard]] inline std::filesystem::path checkpoint_path(const std::filesystem::path& directory,
                                                           std::int64_t step,
                                                           const CheckpointOptions& options = {}) {
  char digits[32];
  std::snprintf(digits, sizeof digits, "%012lld", static_cast<long long>(step));
  return directory / (options.prefix + digits + ".safetensors");
}

/// The checkpoints in `directory`, newest (highest step) first, as (step, path).
[[nodiscard]] inline std::vector<std::pair<std::int64_t, std::filesystem::path>> list_checkpoints(
    const std::filesystem::path& directory, const CheckpointOptions& options = {}) {
  std::vector<std::pair<std::int64_t, std::filesystem::path>> found;
  std::error_code ignored;
  if (!std::filesystem::is_directory(directory, ignored)) return found;
  for (const auto& entry : std::filesystem::directory_iterator(directory, ignored)) {
    const std::string name = entry.path().filename().string();
    const std::string suffix = ".safetensors";
    if (!name.starts_with(options.prefix) || !name.ends_with(suffix)) continue;
    const std::string digits =
        name.substr(options.prefix.size(), name.size() - options.prefix.size() - suffix.size());
    const auto step = detail::whole_number<std::int64_t>(digits);
    if (!step) continue;  // not a step (or one too large to be ours)
    found.emplace_back(*step, entry.path());
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  return found;
}

/// The newest checkpoint in `directory` that is whole: its format valid and its data checksum
/// matching. Each damaged newer one is reported on `report` ("tandem: skipping damaged
/// checkpoint ...") and skipped, never loaded. Empty when there is no checkpoint (a first run).
/// When there are checkpoints but every one is damaged, a tandem::Error naming the newest and
/// why: resuming is impossible, and starting from scratch unasked would silently throw the
/// run's progress away (move the files aside to start afresh on purpose).
[[nodiscard]] inline std::optional<std::filesystem::path> latest_checkpoint(
    const std::filesystem::path& directory, const CheckpointOptions& options = {},
    std::FILE* report = stderr) {
  const auto found = list_checkpoints(directory, options);
  std::string newest_failure;
  for (const auto& [step, path] : found) {
    try {
      SafetensorsFile::map(path).verify_checksum();
      return path;
    } catch (const Error& error) {
      if (newest_failure.empty()) newest_failure = error.operation() + ": " + error.cause();
      if (report)
        std::fprintf(report, "tandem: skipping damaged checkpoint %s: %s\n", path.c_str(),
                     error.what());
    }
  }
  if (!found.empty()) {
    throw Error("latest_checkpoint " + directory.string(),
                "all " + std::to_string(found.size()) +
                    " checkpoint(s) are damaged, so the run cannot resume; refusing to start from "
                    "scratch (move them aside to do that). The newest: " +
                    newest_failure);
  }
  return std::nullopt;
}

/// Saves `state` to `path`: every rank takes part (random generators are gathered), rank 0
/// writes its parameters, buffers and optimizer state (every rank holds the same under DDP,
/// which broadcasts buffers from rank 0) atomically (temporary file, fsync, rename, fsync of the
/// directory), then a barrier. A failure to write on rank 0 is an Error on every rank.
template <Communicator Comm>
void save_checkpoint(Comm& comm, const std::filesystem::path& path, const TrainingState& state) {
  const auto ranks = detail::checkpoint_ranks(comm);
  SafetensorsWriter writer;
  std::string failure;
  try {
    state.save_to(writer, ranks);
    if (comm.rank() == 0) writer.checksum().write(path);
  } catch (const std::exception& error) {
    failure = error.what();
  }
  // Every rank learns whether rank 0 wrote the file before anyone goes on.
  detail::agree_on_failure(comm, failure, "save_checkpoint " + path.string(), "save");
  comm.barrier();
}

/// Saves step `step` into `directory` (created if needed) and, on rank 0, deletes the oldest
/// beyond options.keep_last. Returns the file's path.
template <Communicator Comm>
std::filesystem::path save_checkpoint(Comm& comm, const std::filesystem::path& directory,
                                      std::int64_t step, const TrainingState& state,
                                      const CheckpointOptions& options = {}) {
  if (comm.rank() == 0) std::filesystem::create_directories(directory);
  const auto path = checkpoint_path(directory, step, options);
  save_checkpoint(comm, path, state);
  if (comm.rank() == 0) {
    std::error_code ignored;
    if (options.keep_last > 0) {
      const auto all = list_checkpoints(directory, options);
      for (std::size_t i = options.keep_last; i < all.size(); ++i) {
        std::filesystem::remove(all[i].second, ignored);
      }
    }
    // Temporary files of saves that were killed half-way (this save's was renamed already).
    const std::string stale = "." + options.prefix;
    for (const auto& entry : std::filesystem::directory_iterator(directory, ignored)) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with(stale) && name.find(".safetensors.tmp-") != std::string::npos) {
        std::filesystem::remove(entry.path(), ignored);
      }
    }
  }
  return path;
}

/// Loads `state` from `path` on every rank: each rank reads the file (or, with
/// options.broadcast, rank 0 reads it and broadcasts its bytes). The file's format and data
/// checksum are checked first; any problem is an Error on every rank.
template <Communicator Comm>
void load_checkpoint(Comm& comm, const std::filesystem::path& path, const TrainingState& state,
                     const CheckpointOptions& options = {}) {
  const auto ranks = detail::checkpoint_ranks(comm);
  std::string failure;
  std::optional<SafetensorsFile> file;
  std::vector<std::uint8_t> bytes;
  if (options.broadcast) {
    std::vector<std::int64_t> length{-1};
    if (comm.rank() == 0) {
      try {
        bytes = detail::read_whole_file(path.string());
        // Validated before anything is sent.
        (void)SafetensorsFile::parse(std::as_bytes(std::span<const std::uint8_t>(bytes)),
                                     path.string());
        const std::size_t size = bytes.size();
        length[0] = static_cast<std::int64_t>(size);
      } catch (const std::exception& error) {
        failure = error.what();
      }
    }
    detail::host_broadcast(comm, std::span<std::int64_t>(length), 0);
    if (length[0] < 0) {
      throw Error(comm.rank(), "load_checkpoint " + path.string(),
                  failure.empty() ? "rank 0 could not read the checkpoint" : failure);
    }
    bytes.resize(static_cast<std::size_t>(length[0]));
    detail::host_broadcast(comm, std::span<std::uint8_t>(bytes), 0);
  }
  try {
    file = options.broadcast
               ? SafetensorsFile::parse(std::as_bytes(std::span<const std::uint8_t>(bytes)),
                                        path.string())
               : SafetensorsFile::map(path);
    file->verify_checksum();
    state.load_from(*file, ranks);
  } catch (const std::exception& error) {
    failure = error.what();
  }
  detail::agree_on_failure(comm, failure, "load_checkpoint " + path.string(), "load it");
}

}  // namespace tandem
