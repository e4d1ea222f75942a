// tandem/comm/shm/detail/in_block.hpp - the Engine's shared blocks: allocate_shared (one POSIX
// object per allocation, a part per rank, made like the group's segment: a random name, sized
// to what /dev/shm has free, locked by every rank that maps it, unlinked once all have) and the
// all_reduce of a tensor that lies in one on every rank: each rank reduces its share straight
// from the peers' parts into its own, then copies the others' reduced shares - no copy in.
//   SharedBlock block = engine.allocate_shared(bytes);   engine.all_reduce(p, p, n, op);
// Needs: Linux (through segment.hpp). Not a public header: detail/engine.hpp declares these
// members and shm.hpp includes this header. The design: docs/backends.md, "Buckets in the
// segment".
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
                  "): an all_reduce on a tensor in a shared block (allocate_shared) needs every "
                  "rank's tensor at the same place of one");
}

inline void Engine::wait_reduced(int r, std::uint64_t chunks) {
  const std::atomic<std::uint64_t>& reduced = ranks_[r].reduced;
  if (reduced.load(std::memory_order_acquire) >= chunks) return;
  wait([&] { return reduced.load(std::memory_order_acquire) >= chunks; },
       [&] { return std::vector<int>{r}; },
       [&] {
         return "timed out after " + describe(options_.timeout) + " waiting for rank " +
                std::to_string(r) + " to reduce its share";
       });
}

/// Two barriers and a count per chunk: after the first barrier every rank's tensor is ready (and
/// the calls and places agree); each rank reduces its share (1/n of the elements) chunk by chunk
/// from every rank's part into its own, counting each chunk done in its record, and copies each
/// peer's chunks into its own part as that peer counts them - one of each peer's that is ready,
/// then one of its own, so that it never waits while it has work, and copies a chunk while the
/// peer's cache still holds it where the ranks keep pace; the last barrier ends it, so that no
/// rank writes its part again (the next backward pass, the next collective) while a peer still
/// reads it. A rank writes only its own part: its share in place (no other rank reads that share
/// of it), and a peer's share chunk by chunk once that peer has finished reading it (it counts a
/// chunk after reading every part's). The reduction is LocalComm's arithmetic, in rank order,
/// element by element (reduce_parts): the bits of the slots' path on every rank.
template <class T>
void Engine::all_reduce_in_block(T* data, std::size_t count, ReduceOp op, const InBlock& where) {
  const Place mine{where.id, where.at};
  const std::size_t chunk = std::max<std::size_t>(1, block_chunk_bytes / sizeof(T));
  const bool streaming = count * sizeof(T) >= streaming_copy_bytes;
  const auto n = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  rounds(make_fingerprint<T>(Op::all_reduce, 0, count, 0, op), count, count,
         [&](std::size_t, std::size_t, const Call* call) {
           ranks_[rank_].places[half_] = mine;
           arrive(call);
           check_places(mine);
           std::vector<const T*> parts;
           std::vector<std::size_t> firsts(n);  // rank r's share starts here ...
           std::vector<std::size_t> chunks(n);  // ... and has this many chunks
           std::vector<std::size_t> taken(n);   // chunks of rank r's share this rank has
           parts.reserve(n);
           std::size_t left = 0;  // chunks to reduce or copy
           for (std::size_t r = 0; r < n; ++r) {
             parts.push_back(where.part<T>(static_cast<int>(r)));
             const auto [first, last] = share(static_cast<int>(r), count);
             firsts[r] = first;
             chunks[r] = (last - first + chunk - 1) / chunk;
             left += chunks[r];
           }
           const auto piece = [&](std::size_t r, std::size_t j) {
             const std::size_t at = firsts[r] + j * chunk;
             const std::size_t last = share(static_cast<int>(r), count).second;
             return std::pair{at, std::min(last, at + chunk)};
           };
           const auto ready = [&](std::size_t r) {
             return ranks_[r].reduced.load(std::memory_order_acquire) >= reduced_[r] + taken[r] + 1;
           };
           while (left > 0) {
             bool moved = false;
             for (std::size_t r = 0; r < n; ++r) {
               if (r == me || taken[r] == chunks[r] || !ready(r)) continue;
               const auto [at, end] = piece(r, taken[r]++);
               copy_bytes(reinterpret_cast<const std::byte*>(parts[r] + at),
                          reinterpret_cast<std::byte*>(data + at), (end - at) * sizeof(T),
                          streaming);
               --left;
               moved = true;
             }
             if (taken[me] < chunks[me]) {
               const auto [at, end] = piece(me, taken[me]++);
               reduce_parts(data, parts, at, end, op);
               ranks_[rank_].reduced.store(reduced_[me] + taken[me], std::memory_order_release);
               notify();
               --left;
             } else if (!moved && left > 0) {  // nothing of its own left: wait for a peer's chunk
               for (std::size_t r = 0; r < n; ++r) {
                 if (r == me || taken[r] == chunks[r]) continue;
                 wait_reduced(static_cast<int>(r), reduced_[r] + taken[r] + 1);
                 break;
               }
             }
           }
           for (std::size_t r = 0; r < n; ++r) reduced_[r] += chunks[r];
           arrive(nullptr);
         });
}

}  // namespace tandem::detail::shm
