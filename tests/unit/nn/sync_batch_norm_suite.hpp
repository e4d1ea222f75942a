// tests/unit/nn/sync_batch_norm_suite.hpp - the SyncBatchNorm checks every memory space shares,
// run on LocalComm ranks (threads): PyTorch's numbers for a golden case, the errors that need the
// ranks' values, and a Parameters arena holding the module's parameters and buffers. Templated
// over the space and executor as ddp_suite.hpp is over the communicator: host
// (sync_batch_norm.cpp), the fake device (sync_batch_norm_fake_device.cpp) and a GPU
// (sync_batch_norm_device.cu) each instantiate them. Ranks record what is wrong in a Failures list
// (doctest assertions are not thread-safe); each check reports it.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/error_of.hpp"
#include "syncbn_golden.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/nn/sync_batch_norm.hpp"

namespace tandem::test::syncbn {

/// Golden case `name` on its number of LocalComm ranks, tensors of T in Space, the module on
/// `exec`.
template <class T, class Space, class Exec = default_executor_t<Space>>
void check_golden_case(const std::string& name, Timeout timeout, Exec exec = {}) {
  const GoldenCase gc(name);
  Failures failures;
  run_local(gc.world,
            [&](LocalComm& comm) { check_golden_rank<T, Space>(comm, name, failures, exec); },
            {.timeout = timeout});
  failures.report();
}

/// On 2 ranks: ranks that disagree on the number of channels, and one value per channel across
/// the group (PyTorch: NaN), are Errors on every rank that name the cause; the failed step leaves
/// the running statistics alone and leaves nothing for backward.
template <class Space, class Exec = default_executor_t<Space>>
void check_errors_across_ranks(Timeout timeout) {
  using BN = SyncBatchNorm<LocalComm, float, Space, Exec>;
  std::vector<std::string> messages(4);
  std::vector<std::string> backward_messages(2);
  std::vector<std::int64_t> tracked(2, -1);
  run_local(2,
            [&](LocalComm& comm) {
              const auto r = static_cast<std::size_t>(comm.rank());
              const std::int64_t channels = 3 + comm.rank();
              BN disagree(comm, channels);
              Buffer<float, Space> x(Shape{2, channels, 2});
              Buffer<float, Space> y(x.shape());
              messages[r] = error_of([&] { disagree.forward(x.view(), y.view()); });

              BN bn(comm, 2);
              const auto one = in_space<float, Space>(filled<float>(
                  Shape{comm.rank() == 0 ? 1 : 0, 2},
                  comm.rank() == 0 ? std::vector<double>{1.0, 2.0} : std::vector<double>{}));
              Buffer<float, Space> one_out(one.shape());
              messages[2 + r] = error_of([&] { bn.forward(one.view(), one_out.view()); });
              tracked[r] = bn.num_batches_tracked();
              Buffer<float, Space> dx(one.shape());
              backward_messages[r] =
                  error_of([&] { bn.backward(one.view(), one.view(), dx.view()); });
            },
            {.timeout = timeout});
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(tracked[r] == 0);
    CAPTURE(messages[r]);
    CAPTURE(messages[2 + r]);
    CHECK(contains(messages[r], "SyncBatchNorm::forward"));
    CHECK(contains(messages[r], "disagree on the number of channels"));
    CHECK((contains(messages[r], "rank 1 has 4") || contains(messages[r], "rank 0 has 3")));
    CHECK(contains(messages[2 + r],
                   "expected more than 1 value per channel when training, got 1 across 2 ranks"));
    CHECK(contains(backward_messages[r], "no forward"));
  }
}

/// Golden case r2 with the module's parameters and buffers in a Parameters arena in Space, under
/// PyTorch's names ("bn1.weight", ..., "bn1.num_batches_tracked"), beside another parameter.
template <class Space, class Exec = default_executor_t<Space>>
void check_arena(Timeout timeout) {
  const GoldenCase gc("r2");
  Failures failures;
  run_local(
      gc.world,
      [&](LocalComm& comm) {
        const std::string prefix = "s0/r" + std::to_string(comm.rank());
        const Exec exec{};
        Parameters<float, Space> arena;
        (void)arena.add("conv.weight", {2, 2});
        SyncBatchNorm<LocalComm, float, Space, Exec> bn(comm, arena, "bn1.", gc.channels,
                                                        gc.options);
        failures.expect(contains(error_of([&] { (void)bn.weight(); }), "finalize"),
                        "weight() before finalize is no Error naming finalize");
        arena.finalize(exec);
        bn.reset_parameters();
        bn.executor().synchronize();  // before the synchronous copies below
        auto read = [&](View<const float, Space> values) {
          bn.executor().synchronize();
          return host_copy<float, Space>(values);
        };
        failures.expect(arena.size() == 3, "arena size ", arena.size());
        failures.expect(arena.buffer_count() == 3, "arena buffers ", arena.buffer_count());
        failures.expect(read(arena["bn1.running_var"].value())[0] == 1.0f,
                        "running_var does not start at 1");
        failures.expect(arena["bn1.num_batches_tracked"].kind() == BufferKind::integral,
                        "num_batches_tracked is not integral");
        failures.expect(arena["bn1.running_mean"].kind() == BufferKind::floating,
                        "running_mean is not floating");
        assign(arena["bn1.weight"].value(), gc.at("weight"));
        assign(arena["bn1.bias"].value(), gc.at("bias"));

        const Shape shape = gc.shapes[static_cast<std::size_t>(comm.rank())];
        const auto x = in_space<float, Space>(filled<float>(shape, gc.at(prefix + "/input")));
        const auto dy =
            in_space<float, Space>(filled<float>(shape, gc.at(prefix + "/grad_output")));
        Buffer<float, Space> y(shape);
        Buffer<float, Space> dx(shape);
        arena.zero_grad(exec);
        bn.forward(x.view(), y.view());
        bn.backward(x.view(), dy.view(), dx.view());
        expect_close<float>(failures, "output", read(y.view()).view(), gc.at(prefix + "/output"));
        expect_close<float>(failures, "grad_input", read(dx.view()).view(),
                            gc.at(prefix + "/grad_input"));
        expect_close<float>(failures, "arena grad of bn1.weight",
                            read(arena["bn1.weight"].grad()).view(),
                            gc.at(prefix + "/grad_weight"));
        expect_close<float>(failures, "arena grad of bn1.bias",
                            read(arena["bn1.bias"].grad()).view(), gc.at(prefix + "/grad_bias"));
        expect_close<float>(failures, "arena bn1.running_var",
                            read(arena["bn1.running_var"].value()).view(), gc.at("s0/running_var"),
                            4.0);
        failures.expect(read(arena["bn1.num_batches_tracked"].value())[0] == 1.0f,
                        "arena num_batches_tracked is not 1");
        failures.expect(bn.num_batches_tracked() == 1, "num_batches_tracked ",
                        bn.num_batches_tracked());
        for (float g : read(arena["conv.weight"].grad()))
          failures.expect(g == 0.0f, "conv grad ", g);
      },
      {.timeout = timeout});
  failures.report();
}

}  // namespace tandem::test::syncbn
