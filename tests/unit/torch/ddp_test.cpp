// tandem::torch::DistributedDataParallel on LocalComm ranks (threads): gradients after
// loss.backward() equal one process's gradients over the whole batch, with overlap and with
// sync_at_end, an unused branch, no_sync accumulation, buffers from rank 0, the arena's names,
// and the misuses that must be clear Errors.
// Tolerance: 1e-5 relative (plus 1e-6 absolute). The ranks' mean is (sum of per-rank float
// gradients) / n in rank order, the reference a float sum over the same slices in another order:
// the same numbers up to a few roundings of values of order 1.
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "support/error_of.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/ddp/policies.hpp"
#include "tandem/torch.hpp"

using tandem::LocalComm;
using tandem::test::contains;
using tandem::test::error_of;

namespace {

/// Two layers, a branch used only when asked (an unused parameter), a float buffer and an int64
/// buffer (as BatchNorm has).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
    spare = register_module("spare", torch::nn::Linear(8, 3));
    scale = register_buffer("scale", torch::ones({8}));
    count = register_buffer("count", torch::zeros({1}, torch::kLong));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::tanh(fc1->forward(x)) * scale;
    auto out = fc2->forward(h);
    if (use_spare) out = out + spare->forward(h);
    return out;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, spare{nullptr};
  torch::Tensor scale, count;
  bool use_spare = false;
};
TORCH_MODULE(Net);

constexpr int batch = 24;  // divides by 1, 2, 3 and 4 ranks

struct Data {
  torch::Tensor x = torch::randn({batch, 6});
  torch::Tensor y = torch::randint(0, 3, {batch}, torch::kLong);
};

/// `n` copies of one freshly initialised Net (made on this thread: libtorch's generator is
/// global, so ranks-as-threads must not draw from it concurrently).
std::vector<Net> copies(int n, std::uint64_t seed) {
  std::vector<Net> nets;
  for (int r = 0; r < n; ++r) {
    torch::manual_seed(seed);
    nets.emplace_back();
  }
  return nets;
}

torch::Tensor loss_of(Net& net, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(net->forward(x), y);
}

/// Rank r's slice of micro-batch m (of `micro`) when the batch is split over n ranks.
std::pair<torch::Tensor, torch::Tensor> slice(const Data& d, int n, int r, int micro, int m) {
  const int per = batch / n / micro;
  const int from = r * (batch / n) + m * per;
  return {d.x.slice(0, from, from + per), d.y.slice(0, from, from + per)};
}

/// What DDP must leave in every rank's gradients: the mean over ranks of each rank's summed
/// micro-batch gradients, computed here by one process.
std::vector<torch::Tensor> reference_grads(Net& net, const Data& d, int n, int micro, bool spare) {
  net->use_spare = spare;
  net->zero_grad();
  for (int r = 0; r < n; ++r) {
    for (int m = 0; m < micro; ++m) {
      auto [x, y] = slice(d, n, r, micro, m);
      (loss_of(net, x, y) / n).backward();
    }
  }
  std::vector<torch::Tensor> grads;
  for (auto& p : net->parameters()) {
    grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  }
  return grads;
}

void check_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                 const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool close = torch::allclose(got[i], want[i], 1e-5, 1e-6);
    DOCTEST_CHECK_MESSAGE(close, what << ": gradient " << i << " differs by "
                                      << (got[i] - want[i]).abs().max().item<float>());
  }
}

template <class... Policies>
void gradients_match(int n, int micro, bool spare) {
  torch::set_num_threads(1);
  const Data data;
  auto nets = copies(n + 1, 7);
  const auto want = reference_grads(nets[n], data, n, micro, spare);
  std::vector<std::vector<torch::Tensor>> got(n);
  tandem::run_local(n, [&](LocalComm& comm) {
    const int r = comm.rank();
    Net net = nets[r];
    net->use_spare = spare;
    tandem::torch::DistributedDataParallel<LocalComm, Policies...> ddp(comm, net.ptr());
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();  // set_to_none
    {
      auto guard = ddp.no_sync();
      for (int m = 0; m + 1 < micro; ++m) {
        auto [x, y] = slice(data, n, r, micro, m);
        torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
      }
    }
    auto [x, y] = slice(data, n, r, micro, micro - 1);
    torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
    for (auto& p : net->parameters()) got[r].push_back(p.grad().clone());
  });
  for (int r = 0; r < n; ++r) check_close(got[r], want, "rank " + std::to_string(r));
}

}  // namespace

TEST_CASE("gradients after backward() equal one process's over the whole batch (overlap)") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    gradients_match<>(n, 1, false);
  }
}

TEST_CASE("the same with sync_at_end, and with a branch one step leaves unused") {
  gradients_match<tandem::sync_at_end>(2, 1, false);
  gradients_match<>(3, 1, false);  // spare never used: its gradient is zero everywhere
  gradients_match<>(2, 1, true);   // and used
}

TEST_CASE("no_sync accumulates: two local micro-batches, then one reduced backward") {
  gradients_match<>(2, 2, false);
  gradients_match<>(4, 3, false);
}

TEST_CASE(
    "construction broadcasts rank 0's parameters and buffers; the arena has the module's names") {
  torch::set_num_threads(1);
  std::vector<Net> nets;
  for (int r = 0; r < 3; ++r) {
    torch::manual_seed(100 + r);  // a different initialisation on each rank
    nets.emplace_back();
    nets.back()->scale.fill_(float(r + 1));
    nets.back()->count.fill_(10 * r + 5);
  }
  const auto rank0 = nets[0]->fc1->weight.clone();
  tandem::run_local(3, [&](LocalComm& comm) {
    Net net = nets[comm.rank()];
    tandem::torch::DistributedDataParallel ddp(comm, net.ptr());
    DOCTEST_CHECK(torch::equal(net->fc1->weight, rank0));
    DOCTEST_CHECK(net->scale.eq(1.0f).all().item<bool>());
    DOCTEST_CHECK(net->count.item<std::int64_t>() == 5);

    std::vector<std::string> names;
    for (const auto& item : net->named_parameters()) names.push_back(item.key());
    std::vector<std::string> arena;
    for (const auto& p : ddp.parameters()) arena.push_back(p.name());
    DOCTEST_CHECK(arena == names);
    // The module's tensors are views of the arena: a write through one shows in the other.
    ddp.parameters().values().data()[0] = 42.0f;
    DOCTEST_CHECK(net->fc1->weight.data_ptr<float>()[0] == 42.0f);
  });
}

TEST_CASE("misuse is a clear Error") {
  torch::set_num_threads(1);
  SUBCASE("ranks whose modules differ: every rank names the first difference") {
    std::vector<std::string> errors(2);
    tandem::run_local(2, [&](LocalComm& comm) {
      torch::nn::Sequential net(torch::nn::Linear(4, comm.rank() == 0 ? 3 : 5));
      errors[comm.rank()] =
          error_of([&] { tandem::torch::DistributedDataParallel ddp(comm, net.ptr()); });
    });
    for (const auto& e : errors) {
      CAPTURE(e);
      DOCTEST_CHECK(contains(e, "differ"));
      DOCTEST_CHECK(contains(e, "0.weight"));
      DOCTEST_CHECK(contains(e, "rank 1"));
    }
  }
  SUBCASE("a parameter registered after wrapping") {
    tandem::run_local(1, [](LocalComm& comm) {
      Net net;
      tandem::torch::DistributedDataParallel ddp(comm, net.ptr());
      net->register_parameter("late", torch::zeros({2}));
      const auto e = error_of([&] { ddp.forward(torch::zeros({2, 6})); });
      CAPTURE(e);
      DOCTEST_CHECK(contains(e, "changed after it was wrapped"));
      DOCTEST_CHECK(contains(e, "late"));
    });
  }
  SUBCASE("a double module") {
    tandem::run_local(1, [](LocalComm& comm) {
      Net net;
      net->to(torch::kDouble);
      const auto e = error_of([&] { tandem::torch::DistributedDataParallel ddp(comm, net.ptr()); });
      CAPTURE(e);
      DOCTEST_CHECK(contains(e, "float32"));
    });
  }
  SUBCASE("a non-contiguous or unsupported tensor in a collective") {
    tandem::run_local(1, [](LocalComm& comm) {
      auto t = torch::zeros({3, 4}).t();
      DOCTEST_CHECK(
          contains(error_of([&] { tandem::torch::all_reduce(comm, t); }), "not contiguous"));
      auto b = torch::zeros({4}, torch::kBool);
      DOCTEST_CHECK(contains(error_of([&] { tandem::torch::all_reduce(comm, b); }),
                             "is not one tandem moves"));
    });
  }
}

TEST_CASE("reduce_mean and all_reduce take torch tensors") {
  tandem::run_local(3, [](LocalComm& comm) {
    auto t = torch::full({5}, float(comm.rank() + 1));
    tandem::torch::all_reduce(comm, t);
    DOCTEST_CHECK(t.eq(6.0f).all().item<bool>());
    auto mean = tandem::reduce_mean(comm, torch::full({2}, double(comm.rank())));
    DOCTEST_CHECK(mean.eq(1.0).all().item<bool>());
    auto l = torch::full({1}, std::int64_t{comm.rank()}, torch::kLong);
    tandem::torch::broadcast(comm, l, 2);
    DOCTEST_CHECK(l.item<std::int64_t>() == 2);
  });
}
