// The tandem::Join misuse cases of the Join suite (join_suite.hpp includes this): each one an
// Error with the words that say what happened, on every rank that must know, and never a hang;
// afterwards the communicator still works (a barrier).
#pragma once

#include <optional>
#include <stdexcept>
#include <string>

#include "support/collective_suite.hpp"
#include "support/error_of.hpp"
#include "tandem/ddp/join.hpp"

namespace tandem::test::ddp {

/// The model of the misuse cases: one parameter and one buffer (so before_forward broadcasts).
struct TinyModel {
  Parameters<float> params;
  TinyModel() {
    params.add("w", {3});
    params.add_buffer("stats", {1});
    params.finalize();
  }
  template <class Ddp>
  void step(Ddp& ddp, bool broadcast = true) {
    if (broadcast) ddp.before_forward();
    for (auto& g : params.grads()) g = 1.0f;
    for (auto& p : params) ddp.grad_ready(p);
    ddp.finish_gradient_sync();
  }
};

/// The cases, on n >= 2 ranks. `leaver` is the rank that misbehaves where one does.
template <class Comm, class Runner>
std::size_t check_join_errors(Runner& run, int n) {
  REQUIRE(n >= 2);
  using Ddp = DistributedDataParallel<Comm>;
  Failures failures;
  const int leaver = n - 1;
  auto expect = [&](int me, const char* what, const std::string& text, const auto&... parts) {
    failures.expect(mentions(text, parts...), "rank ", me, " of ", n, ", ", what, ": ", text);
  };
  // A case: body(comm, model, ddp) returns this rank's error text; then a barrier.
  auto each = [&](auto body) {
    run(n, [&](Comm& comm) {
      TinyModel model;
      Ddp ddp(comm, model.params);
      body(comm, model, ddp);
      comm.barrier();
    });
  };

  // throw_on_early_termination (PyTorch's): rank r has 2 + r steps; at the third step every rank
  // raises, the one out of data included.
  each([&](Comm& comm, TinyModel& model, Ddp& ddp) {
    const int me = comm.rank();
    Join join(JoinOptions{.throw_on_early_termination = true}, ddp);
    const std::string text = error_of([&] {
      for (int s = 0; s < 2 + me; ++s) join.step([&] { model.step(ddp); });
      join.finish();
    });
    expect(me, "throw_on_early_termination", text, "throw_on_early_termination",
           "rank 0 ran out of inputs", "step 3 of the Join");
    failures.expect(join.own_steps() == 2, "rank ", me, ": ", join.own_steps(), " steps, not 2");
  });
  // Every rank out of data at the same step: no Error under throw_on_early_termination.
  each([&](Comm& comm, TinyModel& model, Ddp& ddp) {
    Join join(JoinOptions{.throw_on_early_termination = true}, ddp);
    const std::string text = error_of([&] {
      for (int s = 0; s < 2; ++s) join.step([&] { model.step(ddp); });
      join.finish();
    });
    expect(comm.rank(), "even data", text, no_error);
  });
  // A rank that leaves the loop because of an exception: the others raise at the next step.
  each([&](Comm& comm, TinyModel& model, Ddp& ddp) {
    const int me = comm.rank();
    std::string text;
    try {
      Join join(ddp);
      text = error_of([&] {
        for (int s = 0; s < 3; ++s) {
          if (me == leaver && s == 1) throw std::logic_error("the data loader failed");
          join.step([&] { model.step(ddp); });
        }
        join.finish();
      });
    } catch (const std::logic_error& e) {
      text = e.what();
    }
    if (me == leaver) {
      expect(me, "leaving with an exception", text, "the data loader failed");
    } else {
      expect(me, "a rank left with an exception", text,
             "rank " + std::to_string(leaver) + " left the Join because of an exception",
             "step 2 of the Join");
    }
  });
  // A rank whose Join ends without finish().
  each([&](Comm& comm, TinyModel& model, Ddp& ddp) {
    const int me = comm.rank();
    std::string text;
    if (me == leaver) {
      Join join(ddp);
      join.step([&] { model.step(ddp); });
    } else {
      Join join(ddp);
      text = error_of([&] {
        for (int s = 0; s < 3; ++s) join.step([&] { model.step(ddp); });
        join.finish();
      });
      expect(me, "a rank left without finish()", text,
             "rank " + std::to_string(leaver) + " destroyed its Join without calling finish()");
    }
  });
  // A rank with no data at all cannot know what to shadow: every rank raises at once.
  each([&](Comm& comm, TinyModel& model, Ddp& ddp) {
    const int me = comm.rank();
    Join join(ddp);
    const std::string text = error_of([&] {
      for (int s = 0; s < (me == leaver ? 0 : 2); ++s) join.step([&] { model.step(ddp); });
      join.finish();
    });
    expect(me, "a rank without data", text,
           "rank " + std::to_string(leaver) + " ran out of data before running a step like this",
           "step 1 of the Join");
  });
  // Options that differ between ranks.
  each([&](Comm& comm, TinyModel& model, Ddp& ddp) {
    const int me = comm.rank();
    Join join(JoinOptions{.divide_by_initial_world_size = me != leaver}, ddp);
    const std::string text = error_of([&] { join.step([&] { model.step(ddp); }); });
    expect(me, "different options", text, "different joinables or options");
  });
  // no_sync() opened inside join.step(): the rank cannot have announced it.
  each([&](Comm& comm, TinyModel& model, Ddp& ddp) {
    const int me = comm.rank();
    Join join(ddp);
    const std::string text = error_of([&] {
      join.step([&] {
        auto guard = ddp.no_sync();
        model.step(ddp);
      });
    });
    expect(me, "no_sync inside a step", text, "finish_gradient_sync() was not called",
           "no_sync() guard");
  });
  each([&](Comm& comm, TinyModel& model, Ddp& ddp) {
    const int me = comm.rank();
    std::optional<typename Ddp::NoSyncGuard> guard;
    Join join(ddp);
    const std::string text = error_of([&] {
      join.step([&] {
        guard.emplace(ddp.no_sync());
        model.step(ddp);
      });
    });
    expect(me, "a guard left open by a step", text, "opened or closed inside join.step()");
  });
  // A step of the same kind that issues other collectives than the first (no buffer broadcast).
  each([&](Comm& comm, TinyModel& model, Ddp& ddp) {
    const int me = comm.rank();
    Join join(ddp);
    const std::string text = error_of([&] {
      join.step([&] { model.step(ddp); });
      join.step([&] { model.step(ddp, /*broadcast=*/false); });
    });
    expect(me, "another step's collectives", text, "other collectives than the first step",
           "buffer broadcast", "bucket 0");
  });
  // Local errors (nothing collective): a DistributedDataParallel in two Joins; a Join used after
  // finish(); joinables over two communicators.
  each([&](Comm& comm, TinyModel& model, Ddp& ddp) {
    const int me = comm.rank();
    Join join(ddp);
    expect(me, "two Joins", error_of([&] { Join again(ddp); }), "belongs to another Join");
    join.step([&] { model.step(ddp); });
    join.finish();
    expect(me, "after finish()", error_of([&] { join.step([] {}); }), "has finished already");
    auto other_comm = comm.split(0, me);
    REQUIRE(other_comm.has_value());
    TinyModel other_model;
    Ddp other(*other_comm, other_model.params);
    expect(me, "two communicators", error_of([&] { Join both(ddp, other); }),
           "different communicators");
  });
  failures.report();
  return failures.count();
}

}  // namespace tandem::test::ddp
