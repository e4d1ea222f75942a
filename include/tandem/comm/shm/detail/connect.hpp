// tandem/comm/shm/detail/connect.hpp - how the ranks of a new ShmComm group meet: through the
// store they publish their host and pid, rank 0 sizes and creates the segment (within what
// /dev/shm has free) and announces its name, the others map it, and each gets its Engine.
//   std::unique_ptr<Engine> engine = connect(store, "shm/1", rank, size, options);
// Needs: Linux (through segment.hpp). Not a public header: shm.hpp uses it (detail/engine.hpp
// declares connect, which split calls; every user of the Engine includes this header too).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/collective_args.hpp"
#include "tandem/comm/detail/collective_op.hpp"
#include "tandem/comm/detail/flight_monitor.hpp"
#include "tandem/comm/detail/issue_order.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/detail/split_members.hpp"
#include "tandem/comm/shm/detail/engine.hpp"
#include "tandem/comm/shm/detail/in_block.hpp"
#include "tandem/comm/shm/detail/messages.hpp"
#include "tandem/comm/shm/detail/segment.hpp"
#include "tandem/comm/shm/options.hpp"
#include "tandem/core/detail/disagreement.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail::shm {

inline std::string this_host() {
  char host[256] = {};
  return ::gethostname(host, sizeof host - 1) == 0 ? std::string(host) : std::string("?");
}

/// Rank 0's segment for a group of `size` ranks: the layout with slots of `slot_bytes` and rings
/// of default_ring_bytes where it takes at most half of what /dev/shm has free (the rest is for
/// the job's other groups and other jobs), else shrunk to fit (fit_layout; the whole of what is
/// free where half will not do). Where the reservation still fails (another job took the space
/// meanwhile), the budget halves and it tries again. Where the smallest layout does not fit,
/// the Error says what it needs, what is free and what to change - before training starts.
inline Segment make_segment(int size, std::size_t slot_bytes, std::optional<Layout>& layout) {
  constexpr const char* operation = "ShmComm rendezvous";
  const std::size_t free = shm_free_bytes();
  std::size_t budget = free / 2;
  for (;;) {
    layout = fit_layout(size, slot_bytes, budget);
    if (!layout && budget == free / 2) layout = fit_layout(size, slot_bytes, free / 16 * 15);
    if (!layout) break;
    bool no_room = false;
    Segment made = Segment::create(0, *layout, operation, &no_room);
    if (!no_room) return made;
    budget = std::min(budget, layout->total) / 2;
  }
  const Layout least(size, smallest_slot_for(size), smallest_ring_bytes);
  const Layout asked(size, slot_bytes, default_ring_bytes);
  throw Error(
      0, operation,
      "a group of " + std::to_string(size) + " ranks needs at least " + mebibytes(least.total) +
          " of /dev/shm (slots of " + std::to_string(least.slot_bytes >> 10) + " KiB, rings of " +
          std::to_string(least.ring_bytes >> 10) + " KiB; " + mebibytes(asked.total) +
          " as asked), and /dev/shm has " + mebibytes(free) + " free" +
          (process_env(free_bytes_variable) ? " (as " + std::string(free_bytes_variable) + " says)"
                                            : std::string()) +
          ": give the container more shared memory (docker run --shm-size=1g; "
          "Kubernetes: a memory-backed emptyDir on /dev/shm), free some of it (ls "
          "/dev/shm), or use another backend across these ranks (GlooComm or MpiComm; "
          "the examples' --backend gloo)");
}

/// Every member of a new group calls this with the same `prefix` (unique to the group in
/// `store`): the ranks publish their host and pid, rank 0 creates the segment and announces its
/// name, the others map it, and the last to map it unlinks the name. Returns once all have
/// mapped it. `unreadable`: this rank's TANDEM_CHECK_COLLECTIVES could not be read (it still
/// publishes, so that the others raise at once instead of waiting for it).
inline std::unique_ptr<Engine> connect(AnyStore& store, const std::string& prefix, int rank,
                                       int size, const ShmCommOptions& options,
                                       const std::optional<Error>& unreadable) {
  constexpr const char* operation = "ShmComm rendezvous";
  AnyStore scoped(PrefixStore<AnyStore>(prefix, store));
  // "ok PID PID-NAMESPACE HOST": a pid is watched only by ranks of its PID namespace.
  const std::uint64_t my_space = pid_space();
  scoped.set("member/" + std::to_string(rank), std::string(unreadable ? "unreadable " : "ok ") +
                                                   std::to_string(::getpid()) + " " +
                                                   std::to_string(my_space) + " " + this_host());
  std::vector<std::string> hosts;
  std::vector<std::int64_t> pids;
  std::vector<int> bad;
  for (int r = 0; r < size; ++r) {
    const std::string record = scoped.get("member/" + std::to_string(r), options.timeout);
    std::vector<std::string> fields;
    std::size_t at = 0;
    while (fields.size() < 3 && at <= record.size()) {
      const auto space = record.find(' ', at);
      fields.push_back(record.substr(at, space == std::string::npos ? space : space - at));
      at = space == std::string::npos ? record.size() + 1 : space + 1;
    }
    if (fields.front() != "ok") bad.push_back(r);
    const bool here = fields.size() == 3 && fields[2] == std::to_string(my_space);
    pids.push_back(here ? std::atoll(fields[1].c_str()) : 0);
    hosts.push_back(at <= record.size() ? record.substr(at) : std::string());
  }
  if (unreadable) throw *unreadable;
  if (!bad.empty()) {
    throw Error(rank, operation,
                rank_list(bad) + " could not read " + std::string(check_collectives_variable) +
                    " (see that rank's Error)");
  }
  if (auto where = disagreement(hosts, [](const std::string& host) { return host; });
      !where.empty()) {
    throw Error(rank, operation,
                "ShmComm joins the processes of one host, but these ranks run on several (" +
                    where + "); use GlooComm or MpiComm across hosts");
  }
  if (options.slot_bytes < static_cast<std::size_t>(size) * sizeof(std::int64_t)) {
    throw Error(rank, operation,
                "ShmCommOptions::slot_bytes = " + std::to_string(options.slot_bytes) +
                    " is too small for " + std::to_string(size) + " ranks (at least " +
                    std::to_string(size * 8) + ")");
  }
  // Rank 0 sizes the segment to what /dev/shm has free (see make_segment) and announces its
  // name and sizes.
  std::optional<Layout> layout;
  std::optional<Segment> segment;
  if (rank == 0) {
    try {
      segment.emplace(make_segment(size, options.slot_bytes, layout));
    } catch (const Error& e) {
      scoped.set("segment", std::string("!") + e.what());  // the others raise it too
      throw;
    }
    scoped.set("segment", segment->name() + " " + std::to_string(layout->slot_bytes) + " " +
                              std::to_string(layout->ring_bytes));
  } else {
    const std::string record = scoped.get("segment", options.timeout);
    if (!record.empty() && record.front() == '!') {
      throw Error(rank, operation,
                  "rank 0 could not make the group's segment: " + record.substr(1));
    }
    const auto ring_at = record.rfind(' ');
    const auto slot_at = record.rfind(' ', ring_at - 1);
    layout.emplace(size, static_cast<std::size_t>(std::atoll(record.c_str() + slot_at + 1)),
                   static_cast<std::size_t>(std::atoll(record.c_str() + ring_at + 1)));
    segment.emplace(Segment::open(rank, record.substr(0, slot_at), *layout, operation));
  }
  auto engine = std::make_unique<Engine>(std::move(*segment), *layout, rank, std::move(pids), store,
                                         prefix, options);
  engine->join();
  return engine;
}

}  // namespace tandem::detail::shm
