// tandem::torch::SyncBatchNorm and convert_sync_batchnorm on LocalComm thread-ranks: PyTorch's
// numbers (tests/reference/syncbn.txt, golden_syncbn.py: torch.nn.SyncBatchNorm's math for 2 and
// 3 ranks with unequal and empty batches, verified there against F.batch_norm on the whole
// batch), eval mode without communication, running statistics, state keys, and conversion of
// Sequential / ModuleList / ModuleDict / registry-only children, with the member-held case, and a
// forward that fails (a collective that throws, too few values) leaving the module's state alone.
//
// Tolerances. The golden values are exact (float64 from the float32 inputs). In float the
// module computes the statistics with double accumulation (libtorch's batch-norm statistics
// kernel, or torch::var_mean for inputs without spatial dimensions), merges them in double, and
// runs the element-wise passes in float: each output element sees about four float roundings
// (the mean or the shift rounded to float, the product, the sum), so we allow 8 float eps
// relative to the record's largest magnitude (values near zero come from cancellation of terms
// of that size) plus 8 eps of the value itself; running statistics are rounded to float once per
// step: 4 eps relative. In double the only difference from the golden values is summation order:
// 64 double eps relative to the record's scale, far below any arithmetic mistake (the golden
// script's own self-check catches errors of 1e-12 relative). The golden planes hold at most 6
// values; cases with planes of 210 and 784 values (where libtorch's fused kernels sum in float
// within a plane) hold the same float tolerances against batch norm in double on the whole batch.
// libtorch brings glog, whose CHECK(cond) (abort on failure) replaces doctest's CHECK: this file
// spells doctest's DOCTEST_CHECK (CHECK_MESSAGE, REQUIRE and CHECK_THROWS_AS are doctest's).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "support/collective_suite.hpp"
#include "support/error_of.hpp"
#include "support/golden.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/torch/sync_batch_norm.hpp"
#include "unit/nn/instrumented_comm.hpp"

using namespace std::chrono_literals;
using tandem::LocalComm;
using tandem::test::error_of;
using tandem::test::Failures;
namespace tt = tandem::torch;

namespace {

const tandem::test::Golden& golden() {
  static const tandem::test::Golden file("syncbn.txt");
  return file;
}

std::vector<int64_t> shape_of(const std::vector<double>& extents) {
  return {extents.begin(), extents.end()};
}

torch::Tensor tensor_of(const std::vector<double>& values, std::vector<int64_t> shape,
                        torch::ScalarType type) {
  auto flat = torch::tensor(values, torch::kDouble);
  if (values.empty()) flat = torch::zeros({0}, torch::kDouble);
  return flat.reshape(shape).to(type);
}

/// |got - want| <= units * eps(type) * (|want| + scale), scale the record's largest magnitude;
/// an undefined tensor reads as zeros (autograd's None).
void expect_close(Failures& failures, const std::string& what, const torch::Tensor& got,
                  const std::vector<double>& want, torch::ScalarType type, double units) {
  const torch::Tensor values =
      got.defined() ? got.detach().to(torch::kDouble).contiguous().reshape({-1})
                    : torch::zeros({static_cast<int64_t>(want.size())}, torch::kDouble);
  if (static_cast<std::size_t>(values.numel()) != want.size()) {
    failures.add(what, ": ", values.numel(), " values, golden has ", want.size());
    return;
  }
  const double eps = type == torch::kFloat ? std::numeric_limits<float>::epsilon()
                                           : std::numeric_limits<double>::epsilon();
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  const double* data = values.data_ptr<double>();
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double tolerance = units * eps * (std::abs(want[i]) + scale);
    const double error = std::abs(data[i] - want[i]);
    if (!(error <= tolerance)) {
      failures.add(what, "[", i, "] = ", data[i], ", PyTorch ", want[i], " (error ", error, " > ",
                   tolerance, ")");
      return;
    }
  }
}

/// Golden case `name` on its number of LocalComm ranks, every training step then eval mode.
void run_golden_case(const std::string& name, torch::ScalarType type, Failures& failures) {
  const auto& config = golden().values(name + "/config");
  const int world = static_cast<int>(config.at(0));
  const auto channels = static_cast<int64_t>(config.at(1));
  const bool affine = config.at(2) != 0;
  const int steps = static_cast<int>(config.at(5));
  const double units = type == torch::kFloat ? 8.0 : 64.0;
  const double running_units = type == torch::kFloat ? 4.0 : 64.0;

  tandem::run_local(
      world,
      [&](LocalComm& comm) {
        const std::string rank = "r" + std::to_string(comm.rank());
        const auto at = [&](const std::string& key) -> const std::vector<double>& {
          return golden().values(name + "/" + key);
        };
        const auto shape = shape_of(at(rank + "/shape"));
        auto options = torch::nn::BatchNormOptions(channels).eps(config.at(4)).affine(affine);
        if (config.at(3) < 0) {
          // momentum=None (cumulative average). Not `= {}`: c10::optional (1.13) reads that as 0.0.
          options.momentum(std::remove_cvref_t<decltype(options.momentum())>());
        } else {
          options.momentum(config.at(3));
        }
        tt::SyncBatchNorm bn(comm, options);
        bn->to(type);
        if (affine) {
          const torch::NoGradGuard no_grad;
          bn->weight.copy_(tensor_of(at("weight"), {channels}, type));
          bn->bias.copy_(tensor_of(at("bias"), {channels}, type));
        }
        const auto check_pass = [&](const std::string& prefix) {
          const auto x = tensor_of(at(prefix + "/input"), shape, type).requires_grad_(true);
          const auto dy = tensor_of(at(prefix + "/grad_output"), shape, type);
          bn->zero_grad();
          const auto y = bn(x);
          expect_close(failures, name + "/" + prefix + "/output", y, at(prefix + "/output"), type,
                       units);
          (y * dy).sum().backward();
          expect_close(failures, name + "/" + prefix + "/grad_input", x.grad(),
                       at(prefix + "/grad_input"), type, units);
          if (affine) {
            expect_close(failures, name + "/" + prefix + "/grad_weight", bn->weight.grad(),
                         at(prefix + "/grad_weight"), type, units);
            expect_close(failures, name + "/" + prefix + "/grad_bias", bn->bias.grad(),
                         at(prefix + "/grad_bias"), type, units);
          }
        };
        for (int s = 0; s < steps; ++s) {
          const std::string step = "s" + std::to_string(s);
          check_pass(step + "/" + rank);
          expect_close(failures, name + "/" + step + "/running_mean " + rank, bn->running_mean,
                       at(step + "/running_mean"), type, running_units);
          expect_close(failures, name + "/" + step + "/running_var " + rank, bn->running_var,
                       at(step + "/running_var"), type, running_units);
          failures.expect(bn->num_batches_tracked.item<int64_t>() ==
                              static_cast<int64_t>(at(step + "/num_batches_tracked").at(0)),
                          name, " ", step, " ", rank, ": num_batches_tracked ",
                          bn->num_batches_tracked.item<int64_t>());
        }
        bn->eval();
        check_pass("eval/" + rank);
      },
      {.timeout = 60s});
}

/// A LocalComm slice of a batch: rank r's rows of `whole` given the ranks' batch sizes.
torch::Tensor rows_of(const torch::Tensor& whole, const std::vector<int64_t>& sizes, int rank) {
  int64_t start = 0;
  for (int r = 0; r < rank; ++r) start += sizes[static_cast<std::size_t>(r)];
  return whole.narrow(0, start, sizes[static_cast<std::size_t>(rank)]);
}

/// A small conv net as PyTorch users write it with Sequential.
torch::nn::Sequential make_sequential() {
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)),
                            torch::nn::BatchNorm2d(4), torch::nn::ReLU(),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 2, 1)),
                            torch::nn::BatchNorm2d(torch::nn::BatchNormOptions(2).momentum(0.3)));
  // Non-trivial affine parameters and running statistics, so that "keeps values" means something.
  const torch::NoGradGuard no_grad;
  for (auto& buffer : net->named_buffers()) {
    if (buffer.key().find("running_mean") != std::string::npos) buffer.value().uniform_(-1, 1);
    if (buffer.key().find("running_var") != std::string::npos) buffer.value().uniform_(0.5, 2);
    if (buffer.key().find("num_batches_tracked") != std::string::npos) buffer.value().fill_(3);
  }
  for (auto& parameter : net->named_parameters()) parameter.value().uniform_(-1, 1);
  return net;
}

}  // namespace

TEST_CASE("tandem::torch::SyncBatchNorm matches PyTorch on 1, 2 and 3 LocalComm ranks (float)") {
  torch::set_num_threads(1);
  Failures failures;
  run_golden_case("r2", torch::kFloat, failures);       // batches 3 and 1, 1-d spatial, affine
  run_golden_case("r2empty", torch::kFloat, failures);  // batches 0 and 5, (N, C), no affine
  run_golden_case("r3", torch::kFloat, failures);  // batches 4, 0, 2, 2-d spatial, momentum=None
  run_golden_case("w1", torch::kFloat, failures);  // one rank: plain batch norm
  failures.report();
}

TEST_CASE("tandem::torch::SyncBatchNorm matches PyTorch in double") {
  torch::set_num_threads(1);
  Failures failures;
  run_golden_case("r2", torch::kDouble, failures);
  run_golden_case("r3", torch::kDouble, failures);
  failures.report();
}

namespace {

/// A tensor's values as doubles, for expect_close.
std::vector<double> values_of(const torch::Tensor& t) {
  const torch::Tensor flat = t.detach().to(torch::kDouble).contiguous().reshape({-1});
  const double* data = flat.data_ptr<double>();
  return {data, data + flat.numel()};
}

}  // namespace

// The golden cases have planes of at most 6 values; here each (n, c) plane holds hundreds, where
// libtorch's fused CPU kernels sum in float within a plane (see the header's Arithmetic). The
// same tolerances as the golden float cases hold against batch norm in double on the whole batch.
TEST_CASE("SyncBatchNorm on planes of hundreds of values equals double BatchNorm on the batch") {
  torch::set_num_threads(1);
  struct Case {
    std::vector<int64_t> spatial;
    bool affine;
  };
  for (const Case& c : {Case{{28, 28}, true}, Case{{5, 6, 7}, false}}) {
    CAPTURE(c.affine);
    torch::manual_seed(31);
    const std::vector<int64_t> sizes{5, 3};
    const int64_t channels = 3;
    std::vector<int64_t> shape{sizes[0] + sizes[1], channels};
    shape.insert(shape.end(), c.spatial.begin(), c.spatial.end());
    std::vector<int64_t> per_channel(shape.size(), 1);
    per_channel[1] = channels;
    // Channel offsets far from zero, as in the golden cases: (x - mean) cancels.
    const auto x = torch::randn(shape) * 2 + torch::linspace(-3.0, 5.0, channels).view(per_channel);
    const auto dy = torch::randn(shape);
    const auto weight = 0.5 + torch::rand({channels});
    const auto bias = torch::randn({channels});

    const auto x64 = x.to(torch::kDouble).requires_grad_(true);
    torch::Tensor w64, b64;  // undefined without affine
    if (c.affine) {
      w64 = weight.to(torch::kDouble).requires_grad_(true);
      b64 = bias.to(torch::kDouble).requires_grad_(true);
    }
    const auto mean64 = torch::zeros({channels}, torch::kDouble);
    const auto var64 = torch::ones({channels}, torch::kDouble);
    const auto y64 = torch::batch_norm(x64, w64, b64, mean64, var64, /*training=*/true, 0.1, 1e-5,
                                       /*cudnn_enabled=*/false);
    (y64 * dy.to(torch::kDouble)).sum().backward();

    Failures failures;
    tandem::run_local(
        2,
        [&](LocalComm& comm) {
          const std::string rank = " r" + std::to_string(comm.rank());
          tt::SyncBatchNorm bn(comm, torch::nn::BatchNormOptions(channels).affine(c.affine));
          if (c.affine) {
            const torch::NoGradGuard no_grad;
            bn->weight.copy_(weight);
            bn->bias.copy_(bias);
          }
          const auto mine = rows_of(x, sizes, comm.rank()).clone().requires_grad_(true);
          const auto y = bn(mine);
          (y * rows_of(dy, sizes, comm.rank())).sum().backward();
          expect_close(failures, "output" + rank, y, values_of(rows_of(y64, sizes, comm.rank())),
                       torch::kFloat, 8);
          expect_close(failures, "grad_input" + rank, mine.grad(),
                       values_of(rows_of(x64.grad(), sizes, comm.rank())), torch::kFloat, 8);
          expect_close(failures, "running_mean" + rank, bn->running_mean, values_of(mean64),
                       torch::kFloat, 4);
          expect_close(failures, "running_var" + rank, bn->running_var, values_of(var64),
                       torch::kFloat, 4);
          if (!c.affine) return;
          // The ranks' own weight and bias gradients sum to the whole batch's.
          for (auto* grad : {&bn->weight.mutable_grad(), &bn->bias.mutable_grad()}) {
            comm.all_reduce(tandem::View<float>(grad->data_ptr<float>(),
                                                static_cast<std::size_t>(grad->numel())),
                            tandem::ReduceOp::sum);
          }
          expect_close(failures, "summed grad_weight" + rank, bn->weight.grad(),
                       values_of(w64.grad()), torch::kFloat, 8);
          expect_close(failures, "summed grad_bias" + rank, bn->bias.grad(), values_of(b64.grad()),
                       torch::kFloat, 8);
        },
        {.timeout = 60s});
    failures.report();
  }
}

// The fused CPU path does its per-channel work as host loops when the weight and bias are
// contiguous CPU tensors; with strided ones it takes the libtorch ops it replaces. Both must give
// the same bits: output, input/weight/bias gradients and the running statistics, on 2 ranks.
TEST_CASE("SyncBatchNorm's host per-channel path equals its op path bit for bit") {
  torch::set_num_threads(1);
  namespace sbn = tt::detail::sync_batch_norm;
  const int64_t channels = 5;
  Failures failures;
  tandem::run_local(2, [&](LocalComm& comm) {
    torch::manual_seed(7 + comm.rank());
    const auto x = torch::randn({4, channels, 6, 7}) * 3 +
                   torch::linspace(-4.0, 6.0, channels).view({1, channels, 1, 1});
    const auto dy = torch::randn({4, channels, 6, 7});
    const auto weight = 0.5 + torch::rand({channels});
    const auto bias = torch::randn({channels});
    const auto group = std::make_shared<const sbn::Group>(comm);
    struct Result {
      torch::Tensor y, dx, dw, db, running_mean, running_var, tracked;
    };
    auto step = [&](bool strided) {
      // A strided weight and bias (every other element of a [C, 2] tensor) hold the same values.
      auto pick = [&](const torch::Tensor& t) {
        if (!strided) return t.clone().requires_grad_(true);
        return torch::stack({t, t}, 1).select(1, 0).detach().requires_grad_(true);
      };
      auto w = pick(weight);
      auto b = pick(bias);
      auto xin = x.clone().requires_grad_(true);
      sbn::ForwardArgs args;
      args.group = group;
      args.running_mean = torch::full({channels}, 0.25);
      args.running_var = torch::full({channels}, 2.0);
      args.num_batches_tracked = torch::zeros({}, torch::kLong);
      const auto y = sbn::Function::apply(xin, w, b, args);
      (y * dy).sum().backward();
      return Result{y.detach(),
                    xin.grad(),
                    w.grad(),
                    b.grad(),
                    args.running_mean,
                    args.running_var,
                    args.num_batches_tracked};
    };
    const Result host = step(false);
    const Result ops = step(true);
    failures.expect(sbn::host_values(host.running_mean), "the host path was not taken");
    auto same = [](const torch::Tensor& a, const torch::Tensor& b) {
      return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
             std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                         static_cast<std::size_t>(a.numel()) * a.element_size()) == 0;
    };
    const std::string rank = "rank " + std::to_string(comm.rank()) + ": ";
    failures.expect(same(host.y, ops.y), rank, "outputs differ");
    failures.expect(same(host.dx, ops.dx), rank, "input gradients differ");
    failures.expect(same(host.dw, ops.dw), rank, "weight gradients differ");
    failures.expect(same(host.db, ops.db), rank, "bias gradients differ");
    failures.expect(same(host.running_mean, ops.running_mean), rank, "running_mean differs");
    failures.expect(same(host.running_var, ops.running_var), rank, "running_var differs");
    failures.expect(same(host.tracked, ops.tracked), rank, "num_batches_tracked differs");
  });
  failures.report();
}

TEST_CASE("SyncBatchNorm's parameter, buffer and state keys equal BatchNorm2d's") {
  tandem::run_local(1, [](LocalComm& comm) {
    for (bool affine : {true, false}) {
      for (bool track : {true, false}) {
        const auto options =
            torch::nn::BatchNormOptions(5).affine(affine).track_running_stats(track);
        tt::SyncBatchNorm sync(comm, options);
        torch::nn::BatchNorm2d plain(options);
        CAPTURE(affine);
        CAPTURE(track);
        DOCTEST_CHECK(sync->named_parameters().keys() == plain->named_parameters().keys());
        DOCTEST_CHECK(sync->named_buffers().keys() == plain->named_buffers().keys());
        // What torch::save writes (its archive holds parameters then buffers by name).
        for (const auto& p : sync->named_parameters())
          DOCTEST_CHECK((p.value().sizes() == torch::IntArrayRef{5}));
        if (track) DOCTEST_CHECK((sync->num_batches_tracked.scalar_type() == torch::kLong));
        DOCTEST_CHECK(sync->clone()->named_parameters().keys() == plain->named_parameters().keys());
      }
    }
  });
}

TEST_CASE("eval mode uses the running statistics and does not communicate") {
  torch::set_num_threads(1);
  tandem::run_local(2,
                    [](LocalComm& comm) {
                      tt::SyncBatchNorm bn(comm, 3);
                      torch::nn::BatchNorm2d plain(3);
                      {
                        const torch::NoGradGuard no_grad;
                        for (auto* m : {&bn->running_mean, &plain->running_mean})
                          m->copy_(torch::tensor({0.5, -1.0, 2.0}));
                        for (auto* v : {&bn->running_var, &plain->running_var})
                          v->copy_(torch::tensor({1.5, 0.25, 4.0}));
                      }
                      bn->eval();
                      plain->eval();
                      // Only rank 0 calls forward: any collective in it would be unmatched (an
                      // Error here).
                      if (comm.rank() == 0) {
                        const auto x = torch::randn({4, 3, 2, 2});
                        DOCTEST_CHECK(torch::equal(bn(x), plain(x)));
                        DOCTEST_CHECK(torch::equal(bn(x), plain(x)));
                        DOCTEST_CHECK(bn->num_batches_tracked.item<int64_t>() == 0);
                      }
                      comm.barrier();
                    },
                    {.timeout = 20s});
}

TEST_CASE(
    "convert_sync_batchnorm on a Sequential keeps values and equals BatchNorm on the whole batch") {
  torch::set_num_threads(1);
  for (const std::vector<int64_t>& sizes :
       {std::vector<int64_t>{3, 5}, std::vector<int64_t>{2, 4, 3}}) {
    const int world = static_cast<int>(sizes.size());
    CAPTURE(world);
    torch::manual_seed(20);
    auto reference = make_sequential();
    std::vector<torch::nn::Sequential> nets;
    for (int r = 0; r < world; ++r) {
      nets.push_back(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(reference->clone()));
    }
    int64_t total = 0;
    for (auto n : sizes) total += n;
    const auto x = torch::randn({total, 3, 5, 5});
    const auto dy = torch::randn({total, 2, 5, 5});

    // One process over the whole batch with plain BatchNorm: what the ranks together must equal.
    reference->eval();
    const auto eval_before = reference->forward(x);
    reference->train();
    const auto x_whole = x.clone().requires_grad_(true);
    const auto y_whole = reference->forward(x_whole);
    (y_whole * dy).sum().backward();

    Failures failures;
    tandem::run_local(
        world,
        [&](LocalComm& comm) {
          auto& net = nets[static_cast<std::size_t>(comm.rank())];
          const auto old_bn = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(net->ptr(1));
          const auto converted = tt::convert_sync_batchnorm(*net, comm);
          failures.expect(converted.converted == std::vector<std::string>{"1", "4"},
                          "converted names");
          failures.expect(converted.skipped.empty(), "nothing skipped");
          const auto sync = net[1]->as<tt::SyncBatchNorm>();
          failures.expect(sync != nullptr && net->ptr(1) == net->named_children()["1"],
                          "Sequential slot and registry hold the SyncBatchNorm");
          if (sync == nullptr) return;
          failures.expect(sync->weight.is_same(old_bn->weight) &&
                              sync->running_var.is_same(old_bn->running_var) &&
                              sync->num_batches_tracked.is_same(old_bn->num_batches_tracked),
                          "the SyncBatchNorm shares the BatchNorm's tensors");
          failures.expect(net[4]->as<tt::SyncBatchNorm>()->options.momentum().value() == 0.3,
                          "options carried over");

          // Eval: exactly the unconverted model (same kernels, no communication).
          net->eval();
          failures.expect(torch::equal(net->forward(x), eval_before), "eval output changed");
          net->train();

          const auto mine = rows_of(x, sizes, comm.rank()).clone().requires_grad_(true);
          const auto y = net->forward(mine);
          (y * rows_of(dy, sizes, comm.rank())).sum().backward();
          // Float through two layers: 1e-5 relative to the tensor's scale (a few float roundings
          // per pass, amplified by the second layer's normalisation).
          const auto close = [](const torch::Tensor& a, const torch::Tensor& b) {
            return (a - b).abs().max().item<double>() <=
                   1e-5 * std::max(1.0, b.abs().max().item<double>());
          };
          failures.expect(close(y, rows_of(y_whole, sizes, comm.rank())), "rank ", comm.rank(),
                          ": training output differs from BatchNorm on the whole batch");
          failures.expect(close(mine.grad(), rows_of(x_whole.grad(), sizes, comm.rank())), "rank ",
                          comm.rank(), ": input gradient differs");
          for (int layer : {1, 4}) {
            const auto bn = net[static_cast<std::size_t>(layer)]->as<tt::SyncBatchNorm>();
            const auto want =
                reference[static_cast<std::size_t>(layer)]->as<torch::nn::BatchNorm2d>();
            failures.expect(close(bn->running_mean, want->running_mean) &&
                                close(bn->running_var, want->running_var) &&
                                bn->num_batches_tracked.item<int64_t>() == 4,
                            "rank ", comm.rank(), ": running statistics of layer ", layer);
            // The ranks' local weight gradients sum to the whole batch's (DDP would average).
            auto grad = bn->weight.grad().clone();
            comm.all_reduce(
                tandem::View<float>(grad.data_ptr<float>(), static_cast<std::size_t>(grad.numel())),
                tandem::ReduceOp::sum);
            failures.expect(close(grad, want->weight.grad()), "rank ", comm.rank(),
                            ": summed weight gradient of layer ", layer);
          }
        },
        {.timeout = 60s});
    failures.report();
  }
}

namespace {

/// A model as people write them: containers held by members, and one child only the registry
/// holds.
struct Nested : torch::nn::Module {
  Nested() {
    features = register_module(
        "features", torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::BatchNorm1d(6)));
    blocks = register_module(
        "blocks", torch::nn::ModuleList(torch::nn::BatchNorm1d(6), torch::nn::Linear(6, 6)));
    heads = register_module(
        "heads",
        torch::nn::ModuleDict(std::vector<std::pair<std::string, std::shared_ptr<Module>>>{
            {"norm", torch::nn::BatchNorm1d(6).ptr()}, {"out", torch::nn::Linear(6, 2).ptr()}}));
    register_module("loose", torch::nn::BatchNorm3d(2));  // no member: registry only
  }
  torch::nn::Sequential features{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::ModuleDict heads{nullptr};
};

/// A model whose BatchNorm is a struct member: what convert_sync_batchnorm cannot rewire.
struct MemberHeld : torch::nn::Module {
  MemberHeld() {
    conv = register_module("conv", torch::nn::Conv2d(2, 3, 1));
    bn = register_module("bn", torch::nn::BatchNorm2d(3));
    tail = register_module("tail", torch::nn::Sequential(torch::nn::BatchNorm2d(3)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return tail->forward(bn(conv(x))); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Sequential tail{nullptr};
};

}  // namespace

TEST_CASE(
    "convert_sync_batchnorm in a nested module: Sequential, ModuleList, ModuleDict, registry") {
  tandem::run_local(2, [](LocalComm& comm) {
    Nested net;
    const auto keys_before = net.named_parameters().keys();
    const auto buffers_before = net.named_buffers().keys();
    const auto list_weight = net.blocks[0]->as<torch::nn::BatchNorm1dImpl>()->weight;
    const auto converted = tt::convert_sync_batchnorm(net, comm);
    DOCTEST_CHECK((converted.converted ==
                   std::vector<std::string>{"features.1", "blocks.0", "heads.norm", "loose"}));
    DOCTEST_CHECK(converted.skipped.empty());
    DOCTEST_CHECK(net.features[1]->as<tt::SyncBatchNorm>() != nullptr);
    // ModuleList and ModuleDict hold Module pointers: after conversion `as<BatchNorm1d>()` there
    // is null and `as<tandem::torch::SyncBatchNorm>()` is the module (documented).
    DOCTEST_CHECK(net.blocks[0]->as<torch::nn::BatchNorm1d>() == nullptr);
    REQUIRE(net.blocks[0]->as<tt::SyncBatchNorm>() != nullptr);
    DOCTEST_CHECK(net.blocks[0]->as<tt::SyncBatchNorm>()->weight.is_same(list_weight));
    DOCTEST_CHECK(net.heads["norm"]->as<tt::SyncBatchNorm>() != nullptr);
    DOCTEST_CHECK(net.named_children()["loose"]->as<tt::SyncBatchNorm>() != nullptr);
    DOCTEST_CHECK(net.named_children()["loose"]->as<tt::SyncBatchNorm>()->options.num_features() ==
                  2);
    // State keys do not change, so checkpoints and Python's load_state_dict still match.
    DOCTEST_CHECK(net.named_parameters().keys() == keys_before);
    DOCTEST_CHECK(net.named_buffers().keys() == buffers_before);
    // The containers' forward paths reach the new module.
    const auto x = torch::randn({3 + comm.rank(), 4});
    const auto y = net.features->forward(x);
    DOCTEST_CHECK((y.sizes() == torch::IntArrayRef{3 + comm.rank(), 6}));
    // Converting again finds nothing left.
    DOCTEST_CHECK(tt::convert_sync_batchnorm(net, comm).converted.empty());
  });
}

TEST_CASE("a BatchNorm held by a struct member: a clear Error, or skipped when asked") {
  tandem::run_local(2, [](LocalComm& comm) {
    MemberHeld net;
    const auto bn_before = net.bn.ptr();
    const auto tail_before = net.tail->ptr(0);
    std::string what;
    try {
      tt::convert_sync_batchnorm(net, comm);
    } catch (const tandem::Error& e) {
      what = e.what();
    }
    {
      DOCTEST_CHECK(what.find("bn") != std::string::npos);
      DOCTEST_CHECK(what.find("tandem::torch::SyncBatchNorm") != std::string::npos);
    }
    // Nothing changed, not even the Sequential that could have been converted.
    DOCTEST_CHECK(net.named_children()["bn"] == bn_before);
    DOCTEST_CHECK(net.tail->ptr(0) == tail_before);

    const auto converted =
        tt::convert_sync_batchnorm(net, comm, {.member_held = tt::MemberHeldBatchNorm::skip});
    DOCTEST_CHECK(converted.skipped == std::vector<std::string>{"bn"});
    DOCTEST_CHECK(converted.converted == std::vector<std::string>{"tail.0"});
    DOCTEST_CHECK(net.named_children()["bn"] == bn_before);  // registry and member still agree
    DOCTEST_CHECK(
        (net.forward(torch::randn({2, 2, 3, 3})).sizes() == torch::IntArrayRef{2, 3, 3, 3}));
  });
}

namespace {

/// The running statistics and the counter, copied.
std::vector<torch::Tensor> running_state(const tt::SyncBatchNorm& bn) {
  return {bn->running_mean.clone(), bn->running_var.clone(), bn->num_batches_tracked.clone()};
}

bool same_state(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("a forward that fails leaves the running statistics and num_batches_tracked alone") {
  torch::set_num_threads(1);
  Failures failures;
  // On 2 ranks, after a good step: the statistics' all_gather throws, then too few values across
  // the ranks; with momentum and with the cumulative average. The module works afterwards.
  tandem::run_local(
      2,
      [&](LocalComm& local) {
        tandem::test::InstrumentedComm comm(std::move(local));
        for (const bool cumulative : {false, true}) {
          const std::string where =
              "rank " + std::to_string(comm.rank()) + (cumulative ? ", cumulative" : ", momentum");
          auto options = torch::nn::BatchNormOptions(3);
          if (cumulative) options.momentum(std::remove_cvref_t<decltype(options.momentum())>());
          tt::SyncBatchNorm bn(comm, options);
          torch::manual_seed(7 + comm.rank());
          const auto x = torch::randn({2 + comm.rank(), 3, 2});
          (void)bn(x);
          const auto before = running_state(bn);

          comm.failing = true;
          const std::string gone = error_of([&] { (void)bn(x); });
          comm.failing = false;
          failures.expect(gone.find("the test's peer is gone") != std::string::npos, where,
                          ": the failed forward said: ", gone);
          failures.expect(same_state(running_state(bn), before), where,
                          ": a failed collective changed the running statistics or the counter");

          const auto one = torch::randn({comm.rank() == 0 ? 1 : 0, 3});
          const std::string few = error_of([&] { (void)bn(one); });
          failures.expect(few.find("got 1 across 2 ranks") != std::string::npos, where,
                          ": one value per channel said: ", few);
          failures.expect(same_state(running_state(bn), before), where,
                          ": a failed check changed the running statistics or the counter");

          (void)bn(x);
          failures.expect(bn->num_batches_tracked.item<int64_t>() == 2, where, ": ",
                          bn->num_batches_tracked.item<int64_t>(), " batches after two good ones");
        }
      },
      {.timeout = 30s});
  failures.report();
  // One rank (libtorch's batch_norm): the same check, the same Error, nothing changed.
  tandem::run_local(1, [](LocalComm& comm) {
    tt::SyncBatchNorm bn(comm, 3);
    const auto before = running_state(bn);
    const std::string few = error_of([&] { (void)bn(torch::randn({1, 3})); });
    DOCTEST_CHECK(few.find("got 1 in input of shape [1, 3]") != std::string::npos);
    DOCTEST_CHECK(same_state(running_state(bn), before));
  });
}

TEST_CASE("SyncBatchNorm misuse is a tandem::Error on every rank") {
  torch::set_num_threads(1);
  // One value per channel across both ranks: no variance to normalise with.
  CHECK_THROWS_AS(tandem::run_local(2,
                                    [](LocalComm& comm) {
                                      tt::SyncBatchNorm bn(comm, 3);
                                      bn(torch::randn({comm.rank() == 0 ? 1 : 0, 3}));
                                    }),
                  tandem::Error);
  // Ranks that disagree on num_features.
  CHECK_THROWS_AS(tandem::run_local(2,
                                    [](LocalComm& comm) {
                                      const int64_t c = comm.rank() == 0 ? 3 : 4;
                                      tt::SyncBatchNorm bn(comm, c);
                                      bn(torch::randn({2, c}));
                                    }),
                  tandem::Error);
  // The wrong channel count or a 1-d input, on one rank.
  tandem::run_local(1, [](LocalComm& comm) {
    tt::SyncBatchNorm bn(comm, 3);
    CHECK_THROWS_AS(bn(torch::randn({2, 4})), tandem::Error);
    CHECK_THROWS_AS(bn(torch::randn({3})), tandem::Error);
    // nn's SyncBatchNorm's messages (the check both share).
    DOCTEST_CHECK(error_of([&] {
                    (void)bn(torch::randn({2, 4}));
                  }).find("input of shape [2, 4] has 4 channels, this SyncBatchNorm has 3") !=
                  std::string::npos);
    DOCTEST_CHECK(error_of([&] {
                    (void)bn(torch::randn({3}));
                  }).find("at least 2 dimensions, got shape [3]") != std::string::npos);
  });
}
