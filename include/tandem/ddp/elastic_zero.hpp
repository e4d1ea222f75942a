// tandem/ddp/elastic_zero.hpp - tandem::ElasticZero<Opt>: ZeRO-1/2 (the shard<1>/shard<2>
// policies of DistributedDataParallel) that survives a lost rank under tandem::Elastic. Each rank
// steps its own shard of the optimizer and, in a second optimizer, a replica of its ring
// neighbour's (rank r keeps rank r+1's), so that after a loss the survivors hold every shard:
// attach() in the heal's rebuild re-partitions the parameters and the full optimizer state over the
// new group, exactly (docs/elastic.md, "ZeRO"); a replacement (Elastic's on_join, which must not
// carry the optimizer) receives its shard in its first attach, in elastic.start()'s rebuild.
//   tandem::ElasticZero<tandem::optim::AdamW<>> zero(params, [&] { return AdamW(params, {}); });
//   elastic.on_heal([&] { ddp.reset(); }, [&](auto& comm) {
//     ddp.emplace(comm, params); zero.attach(*ddp, elastic.members()); });
//   elastic.step([&](auto&) { zero.gather(*ddp); /* forward, backward */
//                             ddp->finish_gradient_sync(); zero.exchange(*ddp); },
//                [&] { zero.step(); });
//   elastic.settle([&](auto&) { zero.gather(*ddp); });  // the last step's parameters
// Needs: a DistributedDataParallel with shard<1> or shard<2> over a host Parameters arena, and an
// optimizer with shard_to/state_dict/load_state_dict (optim::SGD, optim::AdamW).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/ddp/buckets.hpp"
#include "tandem/ddp/shards.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// A ZeRO optimizer (its shard and a replica of the ring neighbour's) for a group that may lose
/// ranks. Not copyable or movable: the optimizers it shards hold its address.
template <class Opt>
class ElasticZero {
  static_assert(std::is_same_v<typename Opt::memory_space, host>,
                "tandem::ElasticZero: the arena and the optimizer state must be in host memory "
                "(the backends tandem::Elastic heals are CPU ones)");

 public:
  /// The arena's element type.
  using value_type = typename Opt::value_type;
  /// Where the arena and the optimizer state live (host: the backends Elastic heals).
  using memory_space = typename Opt::memory_space;
  /// The optimizer state's element type.
  using state_type = typename Opt::state_type;
  /// The optimizer's state_dict.
  using state_dict_type = typename Opt::state_dict_type;

  /// `make()` returns a fresh optimizer over `params` (the arena DDP wraps), with the options
  /// and param groups of the run; it is called again at each heal (the state is loaded into it).
  ElasticZero(Parameters<value_type, memory_space>& params, std::function<Opt()> make)
      : params_(&params), make_(std::move(make)) {
    for (const auto& parameter : params) offsets_.push_back(parameter.offset());
  }
  ElasticZero(const ElasticZero&) = delete;
  ElasticZero& operator=(const ElasticZero&) = delete;

  /// Binds to `ddp` (built over the group's communicator; `members` is Elastic::members(), the
  /// group's first ranks in rank order). The first call makes the optimizers; a call after a heal
  /// (in the rebuild callback) re-partitions: the survivors put together the parameters and the
  /// full optimizer state from their shards and replicas (collective over ddp.comm()) and load
  /// them into optimizers sharded for the new group. A replacement (Elastic's join: a member new
  /// to the group, whose ElasticZero has not attached yet) calls it once, in elastic.start()'s
  /// rebuild, over a DDP on the new group and with make() giving the members' options: it
  /// contributes nothing, receives the parameters and the full optimizer state in the same
  /// collectives, and shards them like every member. An Error when two ring neighbours were
  /// lost together (a shard and its only replica). When it raises (another loss during the
  /// heal), the shards it holds are kept (the arena's parameters may already be whole): the next
  /// heal runs it again. Collective on every call (one small all_reduce when nothing is held).
  template <class Ddp>
  void attach(Ddp& ddp, std::span<const int> members) {
    static_assert(Ddp::shard_stage > 0, "tandem::ElasticZero needs shard<1> or shard<2>");
    const int n = ddp.world_size();
    const int r = ddp.rank();
    if (static_cast<int>(members.size()) != n) {
      throw Error(r, "ElasticZero::attach",
                  "members lists " + std::to_string(members.size()) + " ranks, the DDP's group " +
                      std::to_string(n));
    }
    const std::vector<int> next(members.begin(), members.end());
    const ShardLayout& layout = ddp.shard_layout();
    const auto neighbour = plan_shards(ddp.buckets(), n, (r + 1) % n);
    std::optional<state_dict_type> full = reassemble(ddp, next);
    // Options set on optimizer() before the group's first attach (an LR schedule made over it
    // sets the learning rates) are the run's: the fresh optimizers keep them. Later attaches
    // load them with the state.
    std::vector<std::decay_t<decltype(std::declval<Opt&>().options(0))>> options;
    if (!full && primary_) {
      for (std::size_t g = 0; g < primary_->group_count(); ++g)
        options.push_back(primary_->options(g));
    }
    std::optional<Opt> primary(make_());
    primary->shard_to(layout.owned(), shard_gather(true));
    std::optional<Opt> replica;
    if (n > 1) {
      replica.emplace(make_());
      replica->shard_to(neighbour.owned(), shard_gather(false));
    }
    if (full) {
      primary->load_state_dict(*full);
      if (replica) replica->load_state_dict(*full);
    }
    for (std::size_t g = 0; g < options.size(); ++g) {
      primary->options(g) = options[g];
      if (replica) replica->options(g) = options[g];
    }
    primary_.reset();
    replica_.reset();
    primary_.emplace(std::move(*primary));
    if (replica) replica_.emplace(std::move(*replica));
    attached_ = true;
    members_ = next;
    buckets_ = ddp.buckets();
    gather_due_ = false;
    exchanged_ = false;
    stage_ = Ddp::shard_stage;
    comm_rank_ = r;
    own_ranges_ = layout.owned();
    kept_ranges_ = n > 1 ? neighbour.owned() : decltype(kept_ranges_){};
    keep_values();
    gather_ = [&ddp, exec = primary_->executor()](View<state_type, memory_space> full,
                                                  std::size_t begin, std::size_t end) {
      const auto& shards = ddp.shard_layout();
      Buffer<state_type, memory_space> staging(shards.staging(), exec);
      detail::ddp::all_gather_parts<state_type, memory_space>(ddp.comm(), exec, shards, full.data(),
                                                              staging.data(), begin, end);
    };
  }

  /// This rank's optimizer (its shard): set its learning rates and options here (an LR
  /// schedule), step() gives them to the replica. The same object across heals (attach re-shards
  /// it in place), so a reference taken once stays valid. Before the first attach (a
  /// replacement, which attaches only after on_join) it is the optimizer make() gives, not yet
  /// sharded: an LR schedule may be made over it, but it does not step; the group's first attach
  /// keeps the options set on it, a replacement's loads the members' options into it.
  [[nodiscard]] Opt& optimizer() {
    if (!primary_) primary_.emplace(make_());
    return *primary_;
  }

  /// Collective at the start of a step's compute: the all_gather of the parameters the last
  /// step updated (each rank updated its own parts), before the forward reads them. Nothing when
  /// they are whole (the first step, after a heal).
  template <class Ddp>
  void gather(Ddp& ddp) {
    if (!gather_due_) return;
    ddp.gather_parameters();
    gather_due_ = false;
  }

  /// Collective after ddp.finish_gradient_sync() in the step's compute. Under shard<2> (each rank
  /// holds only its own parts' reduced gradients) it sends this rank's to the rank that keeps its
  /// replica and receives its neighbour's, which the replica steps on: one shard of gradients
  /// sent per step. Under shard<1> every rank holds every reduced gradient: nothing to send.
  template <class Ddp>
  void exchange(Ddp& ddp) {
    const int n = ddp.world_size();
    if (Ddp::shard_stage == 2 && n > 1) {
      const int r = ddp.rank();
      const auto& own = ddp.shard_layout().owned();
      const auto neighbour = plan_shards(ddp.buckets(), n, (r + 1) % n);
      value_type* grads = params_->grads().data();
      Buffer<value_type, memory_space> out(ddp.shard_layout().owned_elements());
      Buffer<value_type, memory_space> in(neighbour.owned_elements());
      copy_ranges(grads, own, out.data(), true);
      auto& comm = ddp.comm();
      Work sent = comm.send_async(View<const value_type, memory_space>(out.data(), out.size()),
                                  (r + n - 1) % n, exchange_tag);
      try {
        comm.recv(View<value_type, memory_space>(in.data(), in.size()), (r + 1) % n, exchange_tag);
      } catch (...) {
        try {
          sent.wait();
        } catch (...) {  // NOLINT(bugprone-empty-catch): the recv's failure is the one raised
        }
        throw;
      }
      sent.wait();
      copy_ranges(grads, neighbour.owned(), in.data(), false);
    }
    exchanged_ = true;
  }

  /// The step's apply (local, after the commit point): this rank's shard and the replica step.
  /// The parameters they updated are all-gathered by the next gather().
  void step() {
    if (stage_ == 2 && replica_ && !exchanged_) {
      throw Error(comm_rank_, "ElasticZero::step",
                  "under shard<2> the replica needs its neighbour's reduced gradients: call "
                  "exchange(ddp) after finish_gradient_sync() in the step's compute");
    }
    require_in_step("ElasticZero::step");
    primary().step();
    if (replica_) {
      // The owner of the replica's shard steps with its own options, which are this rank's: the
      // run's schedule sets them alike on every rank.
      for (std::size_t g = 0; g < primary().group_count(); ++g) {
        replica_->options(g) = primary().options(g);
      }
      replica_->step();
    }
    keep_values();
    gather_due_ = true;
    exchanged_ = false;
  }

  /// The full optimizer state (collective: every rank's shard gathered), as a DDP run saves it.
  [[nodiscard]] state_dict_type state_dict() const { return primary().state_dict(); }
  /// Loads a full optimizer state (a checkpoint's) into the shard and the replica. Load the
  /// checkpoint's parameters into the arena first (TrainingState loads the model before the
  /// optimizer): a heal before the next step puts the parameters together from those kept here.
  void load_state_dict(const state_dict_type& dict) {
    primary().load_state_dict(dict);
    if (replica_) replica_->load_state_dict(dict);
    keep_values();
  }
  /// True: for TrainingState::optimizer(zero), which then saves it on every rank (state_dict()
  /// is a collective) and loads the full state into the shard and the replica.
  [[nodiscard]] bool sharded() const noexcept { return true; }

 private:
  static constexpr int exchange_tag = 0x2e1a;

  Opt& primary() {
    if (!attached_) throw Error("ElasticZero", "attach(ddp, members) has not been called");
    return *primary_;
  }
  const Opt& primary() const {
    if (!attached_) throw Error("ElasticZero", "attach(ddp, members) has not been called");
    return *primary_;
  }

  /// The gather a sharded optimizer's state_dict() calls: the primary's all-gathers over the
  /// group (a collective); the replica's is never a collective. While `local_` (reassemble), both
  /// leave the other elements as they are: state_dict() then exports this rank's elements only.
  typename Opt::shard_gather shard_gather(bool primary) {
    return [this, primary](View<state_type, memory_space> full, std::size_t begin,
                           std::size_t end) {
      if (local_) return;
      if (!primary) {
        throw Error(comm_rank_, "ElasticZero",
                    "the replica's state is not gathered: call state_dict() on the ElasticZero");
      }
      gather_(full, begin, end);
    };
  }

  /// An Error when the shard and the replica have taken different numbers of steps (the
  /// optimizer was stepped outside step(), or its groups' steps were changed by hand).
  void require_in_step(const char* operation) const {
    if (!replica_) return;
    for (std::size_t g = 0; g < primary().group_count(); ++g) {
      if (primary().group_steps(g) == replica_->group_steps(g)) continue;
      throw Error(comm_rank_, operation,
                  "param group " + std::to_string(g) + " of this rank's shard has taken " +
                      std::to_string(primary().group_steps(g)) + " steps, its replica " +
                      std::to_string(replica_->group_steps(g)) +
                      ": step the optimizer only through ElasticZero::step(), and load a saved "
                      "state through ElasticZero::load_state_dict() (not into optimizer() alone)");
    }
  }

  /// Copies the parameters this rank's shard and the replica own out of the arena: the next
  /// all_gather writes those elements in place, and one that fails half-way may leave them torn.
  void keep_values() {
    value_type* values = params_->values().data();
    own_values_.resize(elements(own_ranges_));
    copy_ranges(values, own_ranges_, own_values_.data(), true);
    kept_values_.resize(elements(kept_ranges_));
    copy_ranges(values, kept_ranges_, kept_values_.data(), true);
  }

  static std::size_t elements(const std::vector<std::pair<std::size_t, std::size_t>>& ranges) {
    std::size_t total = 0;
    for (const auto& range : ranges) total += range.second;
    return total;
  }

  /// copy the elements of `ranges` (arena offsets) of `arena` into `packed` (or back).
  template <class T>
  static void copy_ranges(T* arena, const std::vector<std::pair<std::size_t, std::size_t>>& ranges,
                          T* packed, bool out) {
    std::size_t at = 0;
    for (const auto& [begin, size] : ranges) {
      if (out) {
        std::copy_n(arena + begin, size, packed + at);
      } else {
        std::copy_n(packed + at, size, arena + begin);
      }
      at += size;
    }
  }

  /// Marks which arena elements this survivor holds for the group: 1 its own shard, 2 the
  /// replica of a lost neighbour's (a replacement, new to the group, holds nothing). An Error
  /// when a shard has no holder left.
  template <class Ddp>
  std::vector<std::uint8_t> holdings(Ddp& ddp, const std::vector<int>& next,
                                     const std::vector<std::int64_t>& holds) const {
    // A member of the old group is alive when a rank of the new one holds its state: a
    // replacement takes the first rank of the member it replaces, and holds nothing.
    const auto alive = [&](int m) {
      for (std::size_t i = 0; i < next.size(); ++i) {
        if (next[i] == m && holds[i] != 0) return true;
      }
      return false;
    };
    const int n = static_cast<int>(members_.size());
    const int me = next[static_cast<std::size_t>(ddp.rank())];
    std::vector<std::uint8_t> held(params_->numel(), 0);
    for (int i = 0; i < n; ++i) {
      const int owner = members_[static_cast<std::size_t>(i)];
      const int keeper = members_[static_cast<std::size_t>((i + n - 1) % n)];
      std::uint8_t mark = 0;
      if (alive(owner)) {
        mark = owner == me ? 1 : 0;
      } else if (n > 1 && alive(keeper)) {
        mark = keeper == me ? 2 : 0;
      } else {
        throw Error(ddp.rank(), "ElasticZero::attach",
                    "the optimizer shard of rank " + std::to_string(owner) +
                        " is lost: it and the rank that kept its replica (" +
                        std::to_string(keeper) + ") were lost together; restart from a checkpoint");
      }
      if (mark == 0) continue;
      const ShardLayout shards = plan_shards(buckets_, n, i);
      for (const auto& [begin, size] : shards.owned()) {
        std::fill_n(held.begin() + static_cast<std::ptrdiff_t>(begin), size, mark);
      }
    }
    return held;
  }

  /// Sums `bytes` over the group: each byte is non-zero on at most one rank, so the sum is that
  /// rank's byte, bit for bit (a float sum would turn -0 into +0).
  template <class Comm>
  static void merge(Comm& comm, std::vector<std::uint8_t>& bytes) {
    if (!bytes.empty()) comm.all_reduce(bytes, ReduceOp::sum);
  }

  /// After a loss or a join: the parameters (written into the arena) and the full optimizer
  /// state, put together over the new group from each survivor's shard and the replicas of lost
  /// shards; a replacement contributes zeros and receives them, and the state's layout (the
  /// dict without its tensors' values) from the first survivor. Nothing on a group's first
  /// attach (no rank holds state).
  template <class Ddp>
  std::optional<state_dict_type> reassemble(Ddp& ddp, const std::vector<int>& next) {
    const bool survivor = attached_;
    std::vector<std::uint8_t> held;
    state_dict_type own;
    state_dict_type kept;
    std::vector<std::uint8_t> layout;
    if (survivor) {
      require_in_step("ElasticZero::attach");
      local_ = true;
      try {
        own = primary_->state_dict();
        if (replica_) kept = replica_->state_dict();
      } catch (...) {
        local_ = false;
        throw;
      }
      local_ = false;
      layout = encode_layout(own);
    }
    // Every rank learns which ranks hold state (none on a group's first attach; not a
    // replacement), the state's size and its layout's (the same on every survivor).
    const auto n = static_cast<std::size_t>(ddp.world_size());
    std::vector<std::int64_t> header(n + 2, 0);
    if (survivor) {
      header[static_cast<std::size_t>(ddp.rank())] = 1;
      header[n] = static_cast<std::int64_t>(tensor_elements(own));
      header[n + 1] = static_cast<std::int64_t>(layout.size());
    }
    ddp.comm().all_reduce(header, ReduceOp::max);
    const std::vector<std::int64_t> holds(header.begin(),
                                          header.begin() + static_cast<std::ptrdiff_t>(n));
    const auto first = std::find(holds.begin(), holds.end(), 1);
    if (first == holds.end()) return std::nullopt;
    const bool joined = std::find(holds.begin(), holds.end(), 0) != holds.end();
    // The layout goes to replacements from the first survivor only (each byte from one rank).
    if (!survivor || first - holds.begin() != ddp.rank()) {
      layout.assign(static_cast<std::size_t>(header[n + 1]), 0);
    }
    std::exception_ptr failed;
    try {
      held = survivor ? holdings(ddp, next, holds) : std::vector<std::uint8_t>(params_->numel(), 0);
    } catch (const Error&) {
      failed = std::current_exception();
    }
    if (joined) {  // a replacement cannot see a lost shard itself: the survivors say so
      std::vector<std::uint8_t> lost{failed ? std::uint8_t{1} : std::uint8_t{0}};
      ddp.comm().all_reduce(lost, ReduceOp::max);
      if (lost[0] != 0 && !survivor) {
        throw Error(ddp.rank(), "ElasticZero::attach",
                    "the survivors lost an optimizer shard (a rank and the one that kept its "
                    "replica were lost together): nothing to receive; restart from a checkpoint");
      }
    }
    if (failed) std::rethrow_exception(failed);
    std::vector<value_type> mine(held.size(), value_type{});  // +0: all bits zero
    if (survivor) {
      copy_ranges(mine.data(), own_ranges_, own_values_.data(), false);
      const bool keeper = std::find(held.begin(), held.end(), std::uint8_t{2}) != held.end();
      if (keeper) copy_ranges(mine.data(), kept_ranges_, kept_values_.data(), false);
    }
    std::vector<std::uint8_t> bytes(held.size() * sizeof(value_type));
    std::memcpy(bytes.data(), mine.data(), bytes.size());
    merge(ddp.comm(), bytes);
    if (joined) merge(ddp.comm(), layout);
    if (!survivor) own = decode_layout(layout);
    // Every tensor of the state, in the dict's order (the same on every rank), with where its
    // parameter starts in the arena.
    struct Piece {
      Buffer<state_type, memory_space>* own;
      const state_type* kept;  // the replica's same tensor (null without a replica)
      std::size_t offset;      // where its parameter starts in the arena
    };
    std::vector<Piece> tensors;
    std::size_t total = 0;
    for (std::size_t g = 0; g < own.param_groups.size(); ++g) {
      const auto& group = own.param_groups[g];
      const std::size_t first = survivor ? primary_->group_params(g).first : 0;
      for (std::size_t j = 0; j < group.params.size(); ++j) {
        auto found = own.state.find(group.params[j]);
        if (found == own.state.end()) continue;
        for (auto& [key, tensor] : found->second.tensors) {
          const state_type* other =
              survivor && replica_ ? kept.state.at(found->first).tensors.at(key).data() : nullptr;
          tensors.push_back({&tensor, other, survivor ? offsets_[first + j] : 0});
          total += tensor.size();
        }
      }
    }
    if (total != static_cast<std::size_t>(header[n])) {
      throw Error(ddp.rank(), "ElasticZero::attach",
                  "the optimizer state holds " + std::to_string(total) +
                      " elements here, the survivors' " + std::to_string(header[n]) +
                      ": make() must give every rank the same optimizer");
    }
    std::vector<std::uint8_t> state(total * sizeof(state_type), 0);
    std::size_t at = 0;
    for (const auto& piece : survivor ? tensors : std::vector<Piece>{}) {
      for (std::size_t e = 0; e < piece.own->size(); ++e, ++at) {
        const std::uint8_t mark = held[piece.offset + e];
        if (mark == 0) continue;
        const state_type* from = mark == 1 ? piece.own->data() + e : piece.kept + e;
        std::memcpy(&state[at * sizeof(state_type)], from, sizeof(state_type));
      }
    }
    merge(ddp.comm(), state);
    std::memcpy(params_->values().data(), bytes.data(), bytes.size());
    at = 0;
    for (const auto& piece : tensors) {
      auto* tensor = piece.own;
      std::memcpy(tensor->data(), &state[at * sizeof(state_type)],
                  tensor->size() * sizeof(state_type));
      at += tensor->size();
    }
    return own;
  }

  static std::uint64_t tensor_elements(const state_dict_type& dict) {
    std::uint64_t total = 0;
    for (const auto& entry : dict.state) {
      for (const auto& tensor : entry.second.tensors) total += tensor.second.size();
    }
    return total;
  }

  /// A state dict without its tensors' values (their sizes instead), as bytes: what a
  /// replacement needs to read the state's all_reduce. decode_layout() reads it back.
  static std::vector<std::uint8_t> encode_layout(const state_dict_type& dict) {
    std::vector<std::uint8_t> out;
    const auto put = [&out](const auto& value) {
      const auto* at = reinterpret_cast<const std::uint8_t*>(&value);
      out.insert(out.end(), at, at + sizeof(value));
    };
    const auto put_key = [&](const std::string& key) {
      put(static_cast<std::uint64_t>(key.size()));
      out.insert(out.end(), key.begin(), key.end());
    };
    put(static_cast<std::uint64_t>(dict.param_groups.size()));
    for (const auto& group : dict.param_groups) {
      put(static_cast<std::uint64_t>(group.options.size()));
      for (const auto& [key, value] : group.options) {
        put_key(key);
        put(value);
      }
      put(static_cast<std::uint64_t>(group.params.size()));
      for (std::size_t index : group.params) put(static_cast<std::uint64_t>(index));
      put(group.step);
    }
    put(static_cast<std::uint64_t>(dict.state.size()));
    for (const auto& [index, entry] : dict.state) {
      put(static_cast<std::uint64_t>(index));
      put(static_cast<std::uint64_t>(entry.scalars.size()));
      for (const auto& [key, value] : entry.scalars) {
        put_key(key);
        put(value);
      }
      put(static_cast<std::uint64_t>(entry.tensors.size()));
      for (const auto& [key, tensor] : entry.tensors) {
        put_key(key);
        put(static_cast<std::uint64_t>(tensor.size()));
      }
    }
    return out;
  }

  /// encode_layout()'s bytes back into a dict whose tensors have their sizes (values unset).
  /// An Error when the bytes end early.
  static state_dict_type decode_layout(const std::vector<std::uint8_t>& bytes) {
    std::size_t at = 0;
    const auto get = [&]<class T>(T& value) {
      if (bytes.size() - at < sizeof(T)) {
        throw Error("ElasticZero::attach", "the optimizer state's layout ends early");
      }
      std::memcpy(&value, bytes.data() + at, sizeof(T));
      at += sizeof(T);
    };
    const auto count = [&] {
      std::uint64_t n = 0;
      get(n);
      return static_cast<std::size_t>(n);
    };
    const auto get_key = [&] {
      const std::size_t size = count();
      if (bytes.size() - at < size) {
        throw Error("ElasticZero::attach", "the optimizer state's layout ends early");
      }
      std::string key(reinterpret_cast<const char*>(bytes.data() + at), size);
      at += size;
      return key;
    };
    state_dict_type dict;
    dict.param_groups.resize(count());
    for (auto& group : dict.param_groups) {
      for (std::size_t n = count(); n > 0; --n) {
        std::string key = get_key();
        get(group.options[key]);
      }
      group.params.resize(count());
      for (auto& index : group.params) index = count();
      get(group.step);
    }
    for (std::size_t n = count(); n > 0; --n) {
      auto& entry = dict.state[count()];
      for (std::size_t s = count(); s > 0; --s) {
        std::string key = get_key();
        get(entry.scalars[key]);
      }
      for (std::size_t t = count(); t > 0; --t) {
        std::string key = get_key();
        entry.tensors.emplace(key, Buffer<state_type, memory_space>(count()));
      }
    }
    return dict;
  }

  Parameters<value_type, memory_space>* params_;
  std::function<Opt()> make_;
  std::vector<std::size_t> offsets_;  // each trained parameter's start in the arena
  std::optional<Opt> primary_;
  std::optional<Opt> replica_;
  std::vector<int> members_;     // the group the optimizers are sharded for (first ranks)
  std::vector<Bucket> buckets_;  // and its DDP's buckets
  std::function<void(View<state_type, memory_space>, std::size_t, std::size_t)> gather_;
  std::vector<std::pair<std::size_t, std::size_t>> own_ranges_;   // this rank's shard's
  std::vector<std::pair<std::size_t, std::size_t>> kept_ranges_;  // the replica's
  std::vector<value_type> own_values_;   // own_ranges_' parameters, packed, as the last step left
  std::vector<value_type> kept_values_;  // kept_ranges_'s
  int stage_ = 0;
  int comm_rank_ = 0;
  bool attached_ = false;  // attach has sharded primary_ (before it: make()'s, for optimizer())
  bool local_ = false;     // reassemble: the optimizers' state_dict() exports this rank's elements
  bool gather_due_ = false;
  bool exchanged_ = false;
};

}  // namespace tandem
