// tandem/io/training_state.hpp - TrainingState: the parts of a training run a checkpoint holds
// (parameters and buffers under the model's own names, optimizer moments under PyTorch's names,
// GradScaler, EMA shadow, LR schedule, sampler epoch and position, counters, every rank's RNG),
// registered by reference, saved into a SafetensorsWriter and restored from a SafetensorsFile.
// Loading never trusts the file: every value is checked against its type's range and what it
// restores (shapes against the arena, the sampler's position against its epoch, the GradScaler's
// factors), and a violation is an Error naming the file and the field. A sampler registered with
// its batch size is saved world-size independent: a checkpoint resumes at any world size.
//   tandem::TrainingState state;
//   state.model(params).optimizer(opt).scaler(scaler).ema(ema, params).scheduler(schedule)
//        .sampler(sampler, batches_done, batch_size).counter("step", step).rng("dropout", gen);
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
#include <random>
#include <span>
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
#include "tandem/io/detail/state_fields.hpp"
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

}  // namespace detail

/// What a checkpoint saves of a sampler and checks when it restores one: tandem::DistributedSampler
/// (data/sampler.hpp) models it. The epoch and the batches consumed are restored; the data set
/// size, the options and (without ResplittableSampler's re-split) the rank count must be the
/// ones it was saved with.
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

/// A ResumableSampler whose epoch's rest can be split anew over other ranks
/// (tandem::DistributedSampler): progress(samples_done) says where the epoch stands at any world
/// size (`.epoch`, `.consumed`: positions of the epoch's order taken), continue_from(progress)
/// goes on from there with the sampler's own ranks, resplit(size, rank, samples_done) moves it
/// to new ranks, offset() is where the current split began. A checkpoint of one resumes at any
/// world size.
template <class S>
concept ResplittableSampler = ResumableSampler<S> && std::copy_constructible<S> &&
    requires(S& sampler, const S& seen, std::size_t samples_done, int size) {
  { seen.offset() } -> std::convertible_to<std::size_t>;
  { seen.progress(samples_done).epoch } -> std::convertible_to<std::uint64_t>;
  { seen.progress(samples_done).consumed } -> std::convertible_to<std::size_t>;
  sampler.continue_from(seen.progress(samples_done));
  sampler.resplit(size, size, samples_done);
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

  /// A sampler's epoch and the batches of that epoch already consumed, for a resume at the same
  /// world size: the batch size is not known here, so a checkpoint saved at another world size
  /// is an Error that names the three-argument form, which resumes at any. A position moved by a
  /// re-split (DistributedSampler::offset) is restored where the sampler can re-split.
  template <ResumableSampler Sampler>
  TrainingState& sampler(Sampler& sampler, std::size_t& batches_done, std::string key = "sampler") {
    parts_.push_back(
        {[&sampler, &batches_done, key](SafetensorsWriter&, nlohmann::json& meta,
                                        const CheckpointRanks&) {
           meta[key] = sampler_fields(sampler, batches_done);
         },
         [&sampler, &batches_done, key](const SafetensorsFile& in, const nlohmann::json& meta,
                                        const CheckpointRanks&) {
           const auto saved = read_sampler(in, required(meta, key), sampler, key);
           if (saved.replicas != sampler.num_replicas()) {
             throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                         "the sampler was saved at " + std::to_string(saved.replicas) +
                             " ranks and this job has " + std::to_string(sampler.num_replicas()) +
                             "; register it with its batch size, .sampler(sampler, batches_done, "
                             "batch_size), to resume at another world size");
           }
           if constexpr (ResplittableSampler<Sampler>) {
             sampler.continue_from({saved.epoch, saved.offset});
           } else if (saved.offset != 0) {
             throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                         "the sampler was saved re-split at position " +
                             std::to_string(saved.offset) + " and this one cannot re-split");
           } else {
             sampler.set_epoch(saved.epoch);
           }
           // A batch holds at least one sample: no epoch has more batches than this rank's samples.
           if (saved.batches_done > sampler.size()) {
             throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                         "'" + key + ".batches_done' is " + std::to_string(saved.batches_done) +
                             ", more batches than the epoch's " + std::to_string(sampler.size()) +
                             " samples on this rank");
           }
           batches_done = saved.batches_done;
         }});
    return *this;
  }

  /// A sampler's place in its epoch, world-size independent: saved as the epoch and the
  /// positions of its global order consumed (every rank's `batches_done` batches of
  /// `batch_size`, DistributedSampler::progress), restored at any world size by splitting the
  /// epoch's rest over this job's ranks (continue_from; `batches_done` becomes 0, the first batch
  /// of the new split). At the same world size the samples are those an unstopped run takes;
  /// at another, every sample of the epoch is still used once (padding aside). Loading checks
  /// the data set size, seed, shuffle and drop_last against this sampler's.
  template <ResplittableSampler Sampler>
  TrainingState& sampler(Sampler& sampler, std::size_t& batches_done, std::size_t batch_size,
                         std::string key = "sampler") {
    if (batch_size == 0) throw Error("TrainingState::sampler", "batch_size = 0");
    parts_.push_back(
        {[&sampler, &batches_done, batch_size, key](SafetensorsWriter&, nlohmann::json& meta,
                                                    const CheckpointRanks&) {
           auto fields = sampler_fields(sampler, batches_done);
           fields["consumed"] =
               sampler.progress(samples_taken(batches_done, batch_size, sampler.size())).consumed;
           fields["batch_size"] = batch_size;
           meta[key] = std::move(fields);
         },
         [&sampler, &batches_done, batch_size, key](
             const SafetensorsFile& in, const nlohmann::json& meta, const CheckpointRanks&) {
           const auto& entry = required(meta, key);
           const auto saved = read_sampler(in, entry, sampler, key);
           std::size_t consumed = 0;
           if (entry.contains("consumed")) {
             consumed = detail::json_integer<std::size_t>(entry.at("consumed"), key + ".consumed");
           } else {  // saved by the two-argument form: its batches were this run's size
             Sampler then = sampler;
             then.resplit(saved.replicas, 0, 0);
             then.continue_from({saved.epoch, saved.offset});
             if (saved.batches_done > then.size()) {
               throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                           "'" + key + ".batches_done' is " + std::to_string(saved.batches_done) +
                               ", more batches than the epoch's " + std::to_string(then.size()) +
                               " samples per rank at " + std::to_string(saved.replicas) + " ranks");
             }
             consumed =
                 then.progress(samples_taken(saved.batches_done, batch_size, then.size())).consumed;
           }
           if (consumed < saved.offset || consumed > sampler.dataset_size()) {
             throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                         "'" + key + ".consumed' is " + std::to_string(consumed) +
                             ", outside the epoch's positions " + std::to_string(saved.offset) +
                             " .. " + std::to_string(sampler.dataset_size()));
           }
           sampler.continue_from({saved.epoch, consumed});
           batches_done = 0;
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
  /// one per rank: every rank's state is saved, and each rank gets its own back. At another
  /// world size rank r takes the saved stream r where the file has one; a rank beyond the saved
  /// ones (r >= W, the saved rank count) gets a stream derived from stream r mod W, r and W: the
  /// engine seeded through a std::seed_seq of that stream's saved text, r and W. It is the same
  /// on every resume, differs from the saved streams, and continues none of them. Streams of
  /// ranks that the smaller job does not have are not kept: its next checkpoint holds its own.
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
           if (!saved.is_array() || saved.empty()) {
             throw Error(ranks.rank, "load_checkpoint " + in.name(),
                         "'" + key + "' is not a list of the ranks' generators");
           }
           const auto saved_ranks = saved.size();
           const auto rank = static_cast<std::size_t>(ranks.rank);
           const auto source = rank % saved_ranks;
           const auto state_text = saved[source].template get<std::string>();
           std::istringstream text(state_text);
           Engine restored;
           text >> restored;
           // Printed back, a valid state is the text it was read from: that refuses trailing
           // garbage and words out of the engine's range, which >> would take and wrap.
           std::ostringstream again;
           again << restored;
           if (!text || again.str() != state_text) {
             throw Error(
                 ranks.rank, "load_checkpoint " + in.name(),
                 "'" + key + "' of rank " + std::to_string(source) + " is not a generator's state");
           }
           if (rank >= saved_ranks) {
             std::vector<std::uint32_t> words(state_text.begin(), state_text.end());
             words.push_back(static_cast<std::uint32_t>(rank));
             words.push_back(static_cast<std::uint32_t>(saved_ranks));
             std::seed_seq derived(words.begin(), words.end());
             restored.seed(derived);
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

  /// The state as a one-rank job's checkpoint would hold it, in memory: what Elastic::on_join
  /// sends a replacement (with no disk involved). Not a collective: each random generator is
  /// this rank's alone, and a sharded optimizer (whose state only a collective gathers) cannot be
  /// saved so.
  [[nodiscard]] std::vector<std::byte> to_bytes() const {
    SafetensorsWriter out;
    save_to(out, {0, 1, [](const std::string& mine) { return std::vector<std::string>{mine}; }});
    return out.serialize();
  }

  /// Restores what to_bytes wrote, checked as a checkpoint file is, on rank `rank`: rank 0 takes
  /// the random generators' states as they were sent, another rank a stream derived from them
  /// (rng()'s rule for a rank beyond the saved ones), and the sampler goes on from the sent
  /// position over its own ranks.
  void from_bytes(std::span<const std::byte> bytes, int rank) const {
    const auto file = SafetensorsFile::parse(bytes, "the training state received from a peer");
    load_from(file, {rank, rank + 1,
                     [](const std::string& mine) { return std::vector<std::string>{mine}; }});
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

  // The samples of a rank's list of `size` that `batches` batches of `batch_size` took (the last
  // batch may be short), without overflow.
  static std::size_t samples_taken(std::size_t batches, std::size_t batch_size, std::size_t size) {
    return batches >= (size + batch_size - 1) / batch_size ? size : batches * batch_size;
  }

  // What every form saves of a sampler.
  template <class Sampler>
  static nlohmann::json sampler_fields(const Sampler& sampler, std::size_t batches_done) {
    std::size_t offset = 0;
    if constexpr (requires { sampler.offset(); }) offset = sampler.offset();
    return {{"epoch", sampler.epoch()},
            {"batches_done", batches_done},
            {"offset", offset},
            {"dataset_size", sampler.dataset_size()},
            {"num_replicas", sampler.num_replicas()},
            {"seed", sampler.options().seed},
            {"shuffle", sampler.options().shuffle},
            {"drop_last", sampler.options().drop_last}};
  }

  struct SavedSampler {
    std::uint64_t epoch = 0;
    std::size_t batches_done = 0;
    std::size_t offset = 0;
    int replicas = 1;
  };

  // The saved sampler's fields, checked against this one: the same data set size, seed,
  // shuffle and drop_last (the same order of the same samples), at least one rank.
  template <class Sampler>
  static SavedSampler read_sampler(const SafetensorsFile& in, const nlohmann::json& saved,
                                   const Sampler& sampler, const std::string& key) {
    const auto size =
        detail::json_integer<std::size_t>(saved.at("dataset_size"), key + ".dataset_size");
    const auto seed = detail::json_integer<std::uint64_t>(saved.at("seed"), key + ".seed");
    if (size != sampler.dataset_size() || seed != sampler.options().seed) {
      throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                  "the sampler was saved for " + std::to_string(size) + " samples and seed " +
                      std::to_string(seed) + "; this one has " +
                      std::to_string(sampler.dataset_size()) + " and " +
                      std::to_string(sampler.options().seed));
    }
    const bool shuffle = saved.at("shuffle").template get<bool>();
    const bool drop_last = saved.at("drop_last").template get<bool>();
    if (shuffle != sampler.options().shuffle || drop_last != sampler.options().drop_last) {
      throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                  std::string("the sampler was saved with shuffle ") + (shuffle ? "on" : "off") +
                      " and drop_last " + (drop_last ? "on" : "off") + "; this one has them " +
                      (sampler.options().shuffle ? "on" : "off") + " and " +
                      (sampler.options().drop_last ? "on" : "off"));
    }
    SavedSampler out;
    out.epoch = detail::json_integer<std::uint64_t>(saved.at("epoch"), key + ".epoch");
    out.batches_done =
        detail::json_integer<std::size_t>(saved.at("batches_done"), key + ".batches_done");
    if (saved.contains("offset")) {
      out.offset = detail::json_integer<std::size_t>(saved.at("offset"), key + ".offset");
    }
    out.replicas = detail::json_integer<int>(saved.at("num_replicas"), key + ".num_replicas");
    if (out.replicas < 1 || out.offset > size) {
      throw Error(sampler.rank(), "load_checkpoint " + in.name(),
                  "'" + key + "' has " + std::to_string(out.replicas) + " ranks and offset " +
                      std::to_string(out.offset) + " (at least 1 rank, an offset up to " +
                      std::to_string(size) + ")");
    }
    return out;
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
