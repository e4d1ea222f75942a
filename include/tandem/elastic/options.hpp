// tandem/elastic/options.hpp - tandem::ElasticOptions: how tandem::Elastic heals (the window a
// membership round waits, heals allowed, the smallest group and the largest, replacements and
// how long they are waited for). Its own header so that a program or a launcher can carry the
// options without the whole of elastic.hpp.
//   tandem::ElasticOptions options{.window = std::chrono::seconds(20), .min_world_size = 2};
//   tandem::Elastic<tandem::ShmComm> elastic("file:///tmp/job.store", options);
#pragma once

#include <chrono>

#include "tandem/core/timeout.hpp"

namespace tandem {

/// How Elastic heals.
struct ElasticOptions {
  /// How long a survivor waits in a membership round for members that neither arrived nor are
  /// known lost (members on another host; a live one that does not come) before the group goes
  /// on without them. Members on this host whose process is gone or stopped are not waited for.
  /// Make it longer than a live survivor can take to arrive (its longest step's local work plus
  /// the detection): one that arrives later is left out and raises.
  Timeout window = std::chrono::seconds(10);
  /// Heals allowed over the whole run; one more loss is the job's end (an Error).
  int max_heals = 16;
  /// The smallest group that goes on; a heal that leaves fewer members raises.
  int min_world_size = 1;
  /// This process replaces a lost member: it joins the running group (at its next step
  /// boundary) instead of forming generation 0 with the others. The constructors that read the
  /// environment also set it when TANDEM_ELASTIC_JOIN=1 (tandemrun --elastic --max-restarts sets
  /// it for the workers it restarts).
  bool replacement = false;
  /// How long a replacement waits to be admitted before it raises.
  Timeout join_timeout = std::chrono::minutes(10);
  /// How long the survivors of a loss wait, in the heal, for replacements of the members they
  /// lost before going on without them (0: they do not wait; a replacement joins at a later step
  /// boundary). Waiting keeps the world size, and with it the run bit for bit the undisturbed
  /// one (docs/elastic.md).
  Timeout await_replacement = Timeout::zero();
  /// The most members the group may grow to: processes started to join it (replacement) with
  /// ranks from the job's first size up to this one are admitted as new members (tandemrun
  /// --nnodes MIN:MAX --elastic --rdzv-endpoint: the workers of a node started later). 0, or
  /// less than the first size: the first size (the group never grows). The constructors that
  /// read the environment take TANDEM_ELASTIC_MAX_WORLD_SIZE, which tandemrun sets to MAX x
  /// --nproc-per-node. Every member must have the same.
  int max_world_size = 0;
  /// Rank 0 looks for waiting replacements (one store lookup) at the commit point of every
  /// this many steps; the group learns it through the commit point's all-reduce.
  int join_check_every = 1;
};

}  // namespace tandem
