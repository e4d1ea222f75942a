// tandem/comm/shm/detail/in_block.hpp - the Engine's shared blocks: allocate_shared (one POSIX
// object per allocation, a part per rank, made like the group's segment: a random name, sized
// to what /dev/shm has free, locked by every rank that maps it, unlinked once all have) and the
// collectives of tensors that lie in one on every rank, straight from the peers' parts - no copy
// in: the all_reduce in place (each rank reduces its share and writes it into every part), the
// reduce_scatter in place (each slice reduced into its owner's part) and the all_gather whose
// input lies in the block (each rank copies every part's into its output).
//   SharedBlock block = engine.allocate_shared(bytes);   engine.all_reduce(p, p, n, op);
// Needs: Linux (through segment.hpp). Not a public header: detail/engine.hpp declares these
// members and shm.hpp includes this header. The design: docs/backends.md, "Buckets in the
// segment", and docs/shm.md.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/shared_memory.hpp"
#include "tandem/comm/shm/detail/blocks.hpp"
#include "tandem/comm/shm/detail/engine.hpp"
#include "tandem/comm/shm/detail/segment.hpp"
#include "tandem/core/detail/disagreement.hpp"
#include "tandem/core/error.hpp"
#include "tandem/rendezvous/store.hpp"

namespace tandem::detail::shm {

inline SharedBlock Engine::allocate_shared(std::size_t bytes) {
  start("allocate_shared");
  const std::uint64_t id = blocks_.next_id();
  blocks_.count_one();
  // 64-byte aligned parts (a page each, so that no two ranks write one cache line).
  const std::size_t part = round_up(std::max<std::size_t>(bytes, 1), 4096);
  const auto n = static_cast<std::size_t>(size_);
  SharedBlock made;
  rounds(make_fingerprint(Op::barrier, 0, dtype::float32, 0), 0, 1,
         [&](std::size_t, std::size_t, const Call* call) {
           // Every rank asks for the same size: compared before rank 0 makes anything.
           ranks_[rank_].places[half_] = Place{id, bytes};
           arrive(call);
           std::vector<std::string> asked;
           for (int r = 0; r < size_; ++r) {
             asked.push_back(std::to_string(ranks_[r].places[half_].at) + " bytes");
           }
           if (auto text = disagreement(asked, [](const std::string& s) { return s; });
               !text.empty()) {
             throw Error(rank_, operation_,
                         "ranks ask for blocks of different sizes (" + text +
                             "): allocate_shared is collective");
           }
           AnyStore scoped(PrefixStore<AnyStore>(name_, store_));
           const std::string key = "block/" + std::to_string(id);
           std::shared_ptr<Segment> mapping;
           if (rank_ == 0) {
             // Half of what /dev/shm has free, as for the segment: the rest is for others.
             std::string record = "-";
             if (n * part <= shm_free_bytes() / 2) {
               try {
                 bool no_room = false;
                 Segment object = Segment::create_object(0, n * part, operation_, &no_room);
                 if (!no_room) {
                   mapping = std::make_shared<Segment>(std::move(object));
                   record = mapping->name();
                 }
               } catch (const Error& e) {
                 scoped.set(key, std::string("!") + e.what());
                 throw;
               }
             }
             scoped.set(key, record);
           } else {
             const std::string record = scoped.get(key, options_.timeout);
             if (!record.empty() && record.front() == '!') {
               throw Error(rank_, operation_,
                           "rank 0 could not make the shared block: " + record.substr(1));
             }
             if (record != "-") {
               try {
                 mapping = std::make_shared<Segment>(Segment::open_object(
                     rank_, record, n * part, operation_, "do all ranks run one program?"));
               } catch (const Error& e) {
                 fail(std::string("could not map rank 0's shared block: ") + e.what());
               }
             }
           }
           // Every rank has mapped it (or none will: no room): the name can go. Every rank
           // removes it (the others find it gone), so that none returns while it is listed.
           arrive(nullptr);
           if (!mapping) return;
           mapping->unlink();
           mapping->release_name();
           blocks_.add(BlockRecord{id, mapping->base(), part, mapping});
           made.data = mapping->base() + static_cast<std::size_t>(rank_) * part;
           made.bytes = bytes;
           made.keep = std::move(mapping);
         });
  return made;
}

inline void Engine::check_places(const Place& mine) const {
  bool same = true;
  for (int r = 0; r < size_ && same; ++r) same = ranks_[r].places[half_] == mine;
  if (same) return;
  std::vector<std::string> places;
  for (int r = 0; r < size_; ++r) {
    const Place& place = ranks_[r].places[half_];
    places.push_back(place.block == 0 ? std::string("a tensor outside the shared blocks")
                                      : "shared block " + std::to_string(place.block) +
                                            " at byte " + std::to_string(place.at));
  }
  throw Error(rank_, operation_,
              "ranks disagree on where the tensor lies (" +
                  disagreement(places, [](const std::string& s) { return s; }) +
                  "): " + operation_ +
                  " on a tensor in a shared block (allocate_shared) needs every rank's tensor at "
                  "the same place of one");
}

/// Two barriers, and no wait between them: after the first, every rank's tensor is ready (and
/// the calls and places agree); the `total` elements are cut into n shares (share(r, total)),
/// handed out in chunks of block_chunk_bytes, and run(r, begin, end) is called for each chunk
/// [begin, end) of share r. With `claims` each rank takes the chunks of its own share, then
/// claims what is left of the peers' shares (a chunk is run by the rank that claimed it only), so
/// that a rank the scheduler has not run yet (ranks that share CPUs with other work) finds its
/// share done instead of holding up the others; without, each rank runs every chunk itself (its
/// own share first). The second barrier ends it once every chunk has run (and no rank writes its
/// part again - the next backward pass, the next gather's copy - while a peer still reads it).
/// Before each chunk a rank looks for a failure another rank recorded (or an abort), so that one
/// stopped past the others' timeout and then resumed raises instead of going on writing into
/// their parts. The one loop of the collectives in a block (all_reduce, reduce_scatter,
/// all_gather below).
template <class T, class Run>
void Engine::in_block(const Call& call, const Place& mine, std::size_t total, bool claims,
                      Run&& run) {
  const std::size_t chunk = std::max<std::size_t>(1, block_chunk_bytes / sizeof(T));
  rounds(call, total, total, [&](std::size_t, std::size_t, const Call* first) {
    ranks_[rank_].places[half_] = mine;
    // No peer claims a chunk of this operation before this arrival, nor one of the last
    // operation after it: both ends are barriers.
    ranks_[rank_].claimed.store(0, std::memory_order_relaxed);
    arrive(first);
    check_places(mine);
    for (int k = 0; k < size_; ++k) {  // its own share first, then the peers' in turn
      const int r = (rank_ + k) % size_;
      const auto [begin, end] = share(r, total);
      const std::size_t chunks = (end - begin + chunk - 1) / chunk;
      std::atomic<std::uint64_t>& claimed = ranks_[r].claimed;
      std::uint64_t next = 0;
      // A peer's count is read before it is added to: once its share is all claimed, the line
      // stays in its owner's cache.
      while (!claims || k == 0 || claimed.load(std::memory_order_relaxed) < chunks) {
        const std::uint64_t c = claims ? claimed.fetch_add(1, std::memory_order_relaxed) : next++;
        if (c >= chunks) break;
        if (control_->broken.load(std::memory_order_acquire) != 0 ||
            control_->aborted_by.load(std::memory_order_acquire) != 0) {
          fail(trouble({}));
        }
        const std::size_t at = begin + static_cast<std::size_t>(c) * chunk;
        run(r, at, std::min(end, at + chunk));
      }
    }
    arrive(nullptr);
  });
}

/// Each rank reduces its share (1/n of the elements) chunk by chunk from every rank's part, in
/// rank order, and writes the result into every rank's part - a chunk of any part is read and
/// written by the rank that claimed it only. Per byte reduced a rank reads each part's once and
/// writes each part's once, where a reduction into its own part and a copy of the peers' shares
/// out of theirs read the peers' shares a second time (bench/results/shm-allreduce-2.md). Who
/// reduces a chunk changes nothing in it: the arithmetic is LocalComm's, in rank order, element
/// by element (reduce_chunk), the bits of the slots' path on every rank.
template <class T>
void Engine::all_reduce_in_block(std::size_t count, ReduceOp op, const InBlock& where) {
  const std::vector<T*> parts = where.parts<T>(size_);
  in_block<T>(make_fingerprint<T>(Op::all_reduce, 0, count, 0, op), Place{where.id, where.at},
              count, true, [&](int, std::size_t begin, std::size_t end) {
                reduce_chunk(parts, static_cast<std::size_t>(rank_), true, begin, end, op);
              });
}

/// In place (out is this rank's slice of in): rank r's slice is share r of the n * count
/// elements, reduced from every part in rank order - the bits of the slots' path - and written
/// into part r only, where its owner reads it (ZeRO-2's gradients: ddp/detail/arena_access.hpp);
/// the peers' copies of it stay as they were, as on the slots' path. No copy in, none out
/// (bench/zero/shm_collectives.cpp: 0.22-0.48x of the slots' path on a 41 MB bucket).
template <class T>
void Engine::reduce_scatter_in_block(std::size_t count, ReduceOp op, const InBlock& where) {
  const std::vector<T*> parts = where.parts<T>(size_);
  const std::size_t total = static_cast<std::size_t>(size_) * count;
  in_block<T>(make_fingerprint<T>(Op::reduce_scatter, 0, count, 0, op), Place{where.id, where.at},
              total, true, [&](int r, std::size_t begin, std::size_t end) {
                reduce_chunk(parts, static_cast<std::size_t>(r), false, begin, end, op);
              });
}

/// `in` lies in a block on every rank (ZeRO's staging: ddp/detail/shared_grads.hpp), `out`
/// elsewhere: each rank copies every rank's `in` straight from its part into `out` - no copy into
/// a slot, no barrier per slot. No claims: every rank fills its own `out`. It saves only the copy
/// in (1/n of the bytes): as fast as the slots' path within noise (bench/zero/shm_collectives.cpp)
/// while the output lies outside the block.
template <class T>
void Engine::all_gather_from_block(T* out, std::size_t count, const InBlock& where) {
  const std::vector<T*> parts = where.parts<T>(size_);
  const std::size_t total = static_cast<std::size_t>(size_) * count;
  in_block<T>(make_fingerprint<T>(Op::all_gather, 0, count), Place{where.id, where.at}, total,
              false, [&](int r, std::size_t begin, std::size_t end) {
                const std::size_t first = static_cast<std::size_t>(r) * count;
                copy_elements(
                    static_cast<const T*>(parts[static_cast<std::size_t>(r)]) + (begin - first),
                    end - begin, out + begin);
              });
}

}  // namespace tandem::detail::shm
