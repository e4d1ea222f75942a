// tandem::torch::DistributedDataParallel on LocalComm ranks (threads): gradients after
// loss.backward() equal one process's gradients over the whole batch, with overlap and with
// sync_at_end, an unused branch, no_sync accumulation, buffers from rank 0, the arena's names,
// the misuses that must be clear Errors, and (with the io component) checkpoints under the
// module's state_dict keys: every key once, buffers of every dtype, an exact resume; ZeRO's
// shard<1>/shard<2> through the bridge, bit for bit plain DDP's.
// Tolerance: 1e-5 relative (plus 1e-6 absolute). The ranks' mean is (sum of per-rank float
// gradients) / n in rank order, the reference a float sum over the same slices in another order:
// the same numbers up to a few roundings of values of order 1.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>

#include "gradient_check.hpp"
#include "support/error_of.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/data/loader.hpp"
#include "tandem/ddp/policies.hpp"
#include "tandem/torch.hpp"
#if TANDEM_TEST_IO
#include "tandem/io/checkpoint.hpp"
#include "tandem/io/safetensors.hpp"
#include "tandem/optim/sgd.hpp"
#endif

using tandem::LocalComm;
using tandem::test::contains;
using tandem::test::error_of;

namespace {

using namespace torch_ddp_check;  // Net, Data, slice, reference_grads, ddp_grads

/// `n` copies of one freshly initialised Net, made on this thread (see net_from).
std::vector<Net> copies(int n, std::uint64_t seed) {
  std::vector<Net> nets;
  for (int r = 0; r < n; ++r) nets.push_back(net_from(seed));
  return nets;
}

/// On n LocalComm ranks, DDP's gradients after `micro` micro-batches equal one process's.
template <class... Policies>
void gradients_match(int n, int micro, const SpareUse& spare) {
  torch::set_num_threads(1);
  const Data data;
  auto nets = copies(n + 1, 7);
  const auto want = reference_grads(nets[n], data, n, micro, spare);
  std::vector<std::vector<torch::Tensor>> got(n);
  tandem::run_local(n, [&](LocalComm& comm) {
    const int r = comm.rank();
    nets[r]->use_spare = spare(r);
    got[r] = ddp_grads<Policies...>(comm, nets[r], data, micro);
  });
  for (int r = 0; r < n; ++r) check_close(got[r], want, "rank " + std::to_string(r));
}

/// Each rank's Error (no_error if none) from wrapping make(rank) on n LocalComm ranks (the
/// modules are made here, on one thread: see net_from).
template <class Make>
std::vector<std::string> wrap_errors(int n, Make make) {
  std::vector<decltype(make(0))> modules;
  for (int r = 0; r < n; ++r) modules.push_back(make(r));
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  tandem::run_local(n, [&](LocalComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    errors[r] = error_of([&] { tandem::torch::DistributedDataParallel ddp(comm, modules[r]); });
  });
  return errors;
}

}  // namespace

TEST_CASE("gradients after backward() equal one process's over the whole batch (overlap)") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    gradients_match<>(n, 1, nowhere);
  }
}

TEST_CASE("the same with sync_at_end, and with a branch one step leaves unused") {
  gradients_match<tandem::sync_at_end>(2, 1, nowhere);
  gradients_match<>(3, 1, nowhere);     // spare never used: its gradient is zero everywhere
  gradients_match<>(2, 1, everywhere);  // and used
  gradients_match<>(3, 1, [](int r) { return r == 1; });  // used by one rank only
}

TEST_CASE("no_sync accumulates: two local micro-batches, then one reduced backward") {
  gradients_match<>(2, 2, nowhere);
  gradients_match<>(4, 3, nowhere);
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
    for (const auto& e : wrap_errors(2, [](int r) {
           return torch::nn::Sequential(torch::nn::Linear(4, r == 0 ? 3 : 5));
         })) {
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
  SUBCASE("a rank with one parameter more: the others have 'nothing' there") {
    for (const auto& e : wrap_errors(3, [](int r) {
           torch::nn::Sequential net(torch::nn::Linear(4, 3));
           if (r == 1) net->push_back(torch::nn::Linear(3, 2));
           return net;
         })) {
      DOCTEST_CAPTURE(e);
      DOCTEST_CHECK(contains(e, "differ"));
      DOCTEST_CHECK(contains(e, "ranks 0, 2 have nothing (fewer entries)"));
      DOCTEST_CHECK(contains(e, "rank 1 has parameter '1.weight'"));
    }
  }
  SUBCASE("ranks whose parameters differ in dtype, or whose buffers differ") {
    const auto dtypes = wrap_errors(2, [](int r) {
      torch::nn::Sequential net(torch::nn::Linear(4, 3));
      if (r == 1) net->to(torch::kDouble);
      return net;
    });
    const auto buffers = wrap_errors(2, [](int r) {
      Net net;
      if (r == 0) net->register_buffer("extra", torch::zeros({2}));
      return net;
    });
    for (int r = 0; r < 2; ++r) {
      DOCTEST_CAPTURE(dtypes[r]);
      DOCTEST_CHECK(contains(dtypes[r], "rank 1 has parameter '0.weight' [3, 4] Double"));
      DOCTEST_CHECK(contains(dtypes[r], "rank 0 has parameter '0.weight' [3, 4] Float"));
      DOCTEST_CAPTURE(buffers[r]);
      DOCTEST_CHECK(contains(buffers[r], "buffer 'extra'"));
    }
  }
  SUBCASE("a parameter replaced or converted after wrapping") {
    tandem::run_local(1, [](LocalComm& comm) {
      Net net;
      tandem::torch::DistributedDataParallel ddp(comm, net.ptr());
      {
        torch::NoGradGuard no_grad;
        net->fc2->weight.set_data(torch::zeros({3, 8}));
      }
      auto e = error_of([&] { ddp.forward(torch::zeros({2, 6})); });
      DOCTEST_CAPTURE(e);
      DOCTEST_CHECK(contains(e, "'fc2.weight' no longer lies in the arena"));
    });
    tandem::run_local(1, [](LocalComm& comm) {
      Net net;
      tandem::torch::DistributedDataParallel ddp(comm, net.ptr());
      net->to(torch::kDouble);
      auto e = error_of([&] { ddp.forward(torch::zeros({2, 6}, torch::kDouble)); });
      DOCTEST_CAPTURE(e);
      DOCTEST_CHECK(contains(e, "no longer lies in the arena"));
    });
  }
  SUBCASE("a parameter registered after wrapping, found when backward ends") {
    tandem::run_local(1, [](LocalComm& comm) {
      Net net;
      tandem::torch::DistributedDataParallel ddp(comm, net.ptr());
      auto out = ddp.forward(torch::ones({2, 6}));
      net->fc1->register_parameter("late", torch::zeros({2}));
      const auto e = error_of([&] { out.sum().backward(); });
      DOCTEST_CAPTURE(e);
      DOCTEST_CHECK(contains(e, "changed after it was wrapped"));
      DOCTEST_CHECK(contains(e, "'fc1.late'"));
    });
  }
  SUBCASE("a typed view of the wrong dtype, of a non-contiguous tensor, an integer mean") {
    tandem::run_local(1, [](LocalComm& comm) {
      const auto d = torch::zeros({4}, torch::kDouble);
      auto e = error_of([&] { (void)tandem::torch::view<float>(d); });
      DOCTEST_CHECK(contains(e, "the tensor's dtype is Double, the view's Float"));
      const auto slice = torch::zeros({4, 4}).slice(1, 0, 2);
      e = error_of([&] { (void)tandem::torch::view<float>(slice); });
      DOCTEST_CHECK(contains(e, "not contiguous"));
      e = error_of([&] { comm.all_reduce(tandem::torch::view<float>(d, "my_reduce", 0)); });
      DOCTEST_CHECK(contains(e, "my_reduce"));
      DOCTEST_CHECK(contains(e, "rank 0"));
      e = error_of([&] { (void)tandem::reduce_mean(comm, torch::ones({2}, torch::kLong)); });
      DOCTEST_CHECK(contains(e, "not floating"));
      e = error_of([&] { tandem::torch::broadcast(comm, torch::Tensor(), 0); });
      DOCTEST_CHECK(contains(e, "undefined"));
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

TEST_CASE("misuse: a second backward() in one step is an Error; under no_sync it accumulates") {
  torch::set_num_threads(1);
  const Data data;
  auto nets = copies(3, 7);
  // Two backward()s of one forward under no_sync, then a reduced one: 3x the plain gradients.
  auto want = reference_grads(nets[2], data, 2, 1, nowhere);
  for (auto& g : want) g = g * 3;
  std::vector<std::vector<torch::Tensor>> got(2);
  std::vector<std::string> errors(2);
  tandem::run_local(2, [&](LocalComm& comm) {
    const int r = comm.rank();
    tandem::torch::DistributedDataParallel ddp(comm, nets[r].ptr());
    auto [x, y] = slice(data, 2, r, 1, 0);
    auto loss = torch::nn::functional::cross_entropy(ddp.forward(x), y);
    loss.backward({}, /*retain_graph=*/true);
    errors[r] = error_of([&] { loss.backward(); });

    for (auto& p : nets[r]->parameters()) p.mutable_grad() = torch::Tensor();  // set_to_none
    {
      auto guard = ddp.no_sync();
      auto local = torch::nn::functional::cross_entropy(ddp.forward(x), y);
      local.backward({}, /*retain_graph=*/true);
      local.backward();
    }
    torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
    for (auto& p : nets[r]->parameters()) got[r].push_back(p.grad().clone());
  });
  for (int r = 0; r < 2; ++r) {
    DOCTEST_CAPTURE(errors[r]);
    DOCTEST_CHECK(contains(errors[r], "rank " + std::to_string(r)));
    DOCTEST_CHECK(contains(errors[r], "was marked ready twice in one step"));
    DOCTEST_CHECK(contains(errors[r], "Expected to mark a variable ready only once"));
    DOCTEST_CHECK(contains(errors[r], "parameter 'fc"));
    check_close(got[r], want, "rank " + std::to_string(r) + " after no_sync");
  }
}

namespace {

/// Ten samples: x = {i, i + 0.5, i + 0.25}, y = i * i.
struct Squares {
  using fields = tandem::sample_fields<float, std::int64_t>;
  std::size_t size() const { return 10; }
  std::array<std::size_t, 2> field_numel() const { return {3, 1}; }
  void read(std::size_t i, std::span<float> x, std::span<std::int64_t> y) const {
    x[0] = float(i), x[1] = float(i) + 0.5f, x[2] = float(i) + 0.25f;
    y[0] = std::int64_t(i * i);
  }
};

}  // namespace

TEST_CASE("a Loader batch's fields as torch tensors: views of the batch's memory") {
  const Squares data;
  const std::vector<std::vector<std::int64_t>> order{{3, 1, 4, 0}, {9, 2, 6, 5}, {7, 8}};
  tandem::Loader loader(data, order, {.workers = 1});
  std::size_t seen = 0;
  for (const auto& batch : loader) {
    const auto [x, y] = tandem::torch::tensors(batch);
    const auto n = static_cast<std::int64_t>(batch.size());
    DOCTEST_CHECK((x.sizes() == torch::IntArrayRef{n, 3}));
    DOCTEST_CHECK((y.sizes() == torch::IntArrayRef{n, 1}));
    DOCTEST_CHECK((x.scalar_type() == torch::kFloat));
    DOCTEST_CHECK((y.scalar_type() == torch::kLong));
    DOCTEST_CHECK(x.device().is_cpu());
    const auto [images, labels] = batch.views();
    DOCTEST_CHECK(x.data_ptr() == static_cast<void*>(images.data()));  // no copy
    DOCTEST_CHECK(y.data_ptr() == static_cast<void*>(labels.data()));
    for (std::int64_t k = 0; k < n; ++k) {
      const auto i = order[seen][static_cast<std::size_t>(k)];
      DOCTEST_CHECK(y[k][0].item<std::int64_t>() == i * i);
      DOCTEST_CHECK(x[k][1].item<float>() == float(i) + 0.5f);
    }
    ++seen;
  }
  DOCTEST_CHECK(seen == order.size());
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

TEST_CASE("tandem's communicators take torch tensors directly (comm.all_reduce(t))") {
  tandem::run_local(3, [](LocalComm& comm) {
    const int r = comm.rank();
    auto t = torch::full({5}, float(r + 1));
    comm.all_reduce(t);
    DOCTEST_CHECK(t.eq(6.0f).all().item<bool>());
    auto longs = torch::full({2}, std::int64_t{r}, torch::kLong);
    comm.all_reduce(longs, tandem::ReduceOp::max);
    DOCTEST_CHECK(longs.eq(2).all().item<bool>());
    auto halves = torch::full({3}, float(r), torch::kHalf);
    comm.all_reduce_async(halves).wait();
    DOCTEST_CHECK(halves.to(torch::kFloat).eq(3.0f).all().item<bool>());
    auto b = torch::full({4}, double(r));
    comm.broadcast(b, 1);
    DOCTEST_CHECK(b.eq(1.0).all().item<bool>());

    // (in, out) pairs: both torch, or a torch tensor beside a tandem View of its dtype.
    const auto mine = torch::full({2}, std::int32_t(10 * r), torch::kInt);
    auto all = torch::empty({6}, torch::kInt);
    comm.all_gather(mine, all);
    DOCTEST_CHECK(all.equal(torch::tensor({0, 0, 10, 10, 20, 20}, torch::kInt)));
    auto parts = torch::empty({2});
    comm.reduce_scatter(torch::arange(6, torch::kFloat), parts);
    DOCTEST_CHECK(parts.equal(torch::tensor({0.0f, 3.0f}) + 6.0f * r));  // 3 x [0, 6)
    std::vector<float> sums(3);
    const auto ones = torch::ones({3});
    comm.all_reduce(ones, tandem::View<float>(sums.data(), sums.size()));
    DOCTEST_CHECK(sums == std::vector<float>{3, 3, 3});

    // Point to point: rank 0 sends rank 1 a tensor.
    if (r == 0) comm.send(torch::tensor({7, 8}, torch::kLong), 1);
    if (r == 1) {
      auto got = torch::zeros({2}, torch::kLong);
      comm.recv(got, 0);
      DOCTEST_CHECK(got.equal(torch::tensor({7, 8}, torch::kLong)));
    }

    // Errors name the operation and the cause, on every rank alike (nothing was sent).
    auto e = error_of([&] { comm.all_reduce(torch::zeros({3, 4}).t()); });
    DOCTEST_CHECK(contains(e, "all_reduce"));
    DOCTEST_CHECK(contains(e, "not contiguous"));
    e = error_of([&] { comm.all_reduce(torch::zeros({4}, torch::kBool)); });
    DOCTEST_CHECK(contains(e, "is not one tandem moves"));
    auto doubles = torch::empty({6}, torch::kDouble);
    e = error_of([&] { comm.all_gather(torch::zeros({2}), doubles); });
    DOCTEST_CHECK(contains(e, "the tensor's dtype is Double, the view's Float"));
  });
}

#if TANDEM_TEST_IO
namespace {

/// The model that tests/unit/torch/load_state_dict.py builds in PyTorch: nested names, a
/// BatchNorm (float running statistics, the int64 num_batches_tracked), a frozen parameter (in
/// the arena's buffer block) and a tied one ("tied" and "head.weight", one tensor).
struct TinyImpl : torch::nn::Module {
  TinyImpl() {
    body = register_module("body",
                           torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::BatchNorm1d(6),
                                                 torch::nn::ReLU()));
    head = register_module("head", torch::nn::Linear(6, 3));
    tied = register_parameter("tied", head->weight);
    body[0]->as<torch::nn::Linear>()->bias.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) { return head->forward(body->forward(x)); }
  torch::nn::Sequential body{nullptr};
  torch::nn::Linear head{nullptr};
  torch::Tensor tied;
};
TORCH_MODULE(Tiny);

/// Two ranks' batches for `steps` steps, drawn on this thread (libtorch's generator is global).
struct Steps {
  Steps(int steps, std::uint64_t seed) {
    torch::manual_seed(seed);
    for (int s = 0; s < steps; ++s) {
      for (int r = 0; r < 2; ++r) {
        x.push_back(torch::randn({5, 4}));
        y.push_back(torch::randint(0, 3, {5}, torch::kLong));
      }
    }
  }
  std::vector<torch::Tensor> x, y;  // step s, rank r at 2 * s + r
};

template <class Ddp, class Optimizer>
void train(Ddp& ddp, Optimizer& opt, const Steps& data, int rank, int from, int to) {
  for (int s = from; s < to; ++s) {
    const auto i = static_cast<std::size_t>(2 * s + rank);
    auto loss = torch::nn::functional::cross_entropy(ddp.forward(data.x[i]), data.y[i]);
    opt.zero_grad();
    loss.backward();
    ddp.step(opt);  // opt.step(), and under ZeRO the parameters' all_gather
  }
}

/// Every state_dict key of the module, sorted.
std::vector<std::string> state_dict_keys(torch::nn::Module& module) {
  std::vector<std::string> keys;
  for (const auto& item : module.named_parameters()) keys.push_back(item.key());
  for (const auto& item : module.named_buffers()) keys.push_back(item.key());
  std::sort(keys.begin(), keys.end());
  return keys;
}

/// Clones of every parameter and buffer, in state_dict order.
std::vector<torch::Tensor> snapshot(torch::nn::Module& module) {
  std::vector<torch::Tensor> out;
  for (const auto& item : module.named_parameters()) out.push_back(item.value().detach().clone());
  for (const auto& item : module.named_buffers()) out.push_back(item.value().clone());
  return out;
}

/// A fresh directory for this test's files; TANDEM_TORCH_STATE_DICT_DIR when set (the Python
/// check, torch_state_dict_python, reads the files from there).
std::filesystem::path test_directory(const char* name) {
  if (const char* dir = std::getenv("TANDEM_TORCH_STATE_DICT_DIR")) {
    std::filesystem::create_directories(dir);
    return dir;
  }
  auto dir = std::filesystem::temp_directory_path() /
             ("tandem-torch-" + std::string(name) + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE("checkpoints: tensors under the module's state_dict keys, each once, every buffer") {
  torch::set_num_threads(1);
  const auto dir = test_directory("state-dict");
  std::vector<Tiny> nets;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(3);
    nets.emplace_back();
  }
  const Steps data(3, 4);
  torch::manual_seed(5);
  const auto probe = torch::randn({7, 4});
  tandem::run_local(2, [&](LocalComm& comm) {
    const int r = comm.rank();
    tandem::torch::DistributedDataParallel ddp(comm, nets[r].ptr());
    tandem::optim::SGD opt(ddp.parameters(), {.lr = 0.1});
    train(ddp, opt, data, r, 0, 3);
    tandem::TrainingState state;
    tandem::torch::model(state, ddp);  // a model-only file
    tandem::save_checkpoint(comm, dir / "model.safetensors", state);
    if (r == 0) {  // what the model computes, for the Python check to compare with
      nets[r]->eval();
      torch::NoGradGuard no_grad;
      const auto y = ddp.forward(probe).contiguous();
      tandem::SafetensorsWriter expected;
      expected.add("x", tandem::torch::view<float>(probe), {7, 4});
      expected.add("y", tandem::torch::view<float>(y), {7, 3});
      expected.write(dir / "expected.safetensors");
    }
  });
  Tiny& net = nets[0];  // unwrapped: its own copies of what the arena held
  const auto file = tandem::SafetensorsFile::map(dir / "model.safetensors");
  std::vector<std::string> in_file;
  for (const auto& entry : file.tensors()) in_file.push_back(entry.name);
  std::sort(in_file.begin(), in_file.end());
  const auto keys = state_dict_keys(*net);
  DOCTEST_CHECK(in_file == keys);
  DOCTEST_CHECK(std::find(keys.begin(), keys.end(), "body.1.num_batches_tracked") != keys.end());
  DOCTEST_CHECK(std::find(keys.begin(), keys.end(), "tied") != keys.end());
  DOCTEST_CHECK(file.entry("body.1.num_batches_tracked").dtype == tandem::st_dtype::I64);
  DOCTEST_CHECK(file.values<std::int64_t>("body.1.num_batches_tracked") ==
                std::vector<std::int64_t>{3});
  // 0-dimensional, as PyTorch holds it (and as libtorch's BatchNorm registers it).
  DOCTEST_CHECK(file.entry("body.1.num_batches_tracked").shape.empty());
  DOCTEST_CHECK(file.entry("body.1.running_var").shape == std::vector<std::int64_t>{6});
  DOCTEST_CHECK(file.entry("head.weight").shape == std::vector<std::int64_t>{3, 6});
  for (const auto& item : net->named_parameters()) {
    auto values = file.values<float>(item.key());
    DOCTEST_CHECK_MESSAGE(
        torch::equal(torch::from_blob(values.data(), item.value().sizes()), item.value()),
        item.key());
  }
  for (const auto& item : net->named_buffers()) {
    if (item.value().scalar_type() != torch::kFloat) continue;
    auto values = file.values<float>(item.key());
    DOCTEST_CHECK_MESSAGE(
        torch::equal(torch::from_blob(values.data(), item.value().sizes()), item.value()),
        item.key());
  }
  if (!std::getenv("TANDEM_TORCH_STATE_DICT_DIR")) std::filesystem::remove_all(dir);
}

TEST_CASE("checkpoints: a file holding num_batches_tracked 1-dimensional (older tandem) loads") {
  torch::set_num_threads(1);
  const auto dir = test_directory("legacy-count");
  torch::manual_seed(3);
  Tiny saved, loaded;
  saved->body[1]->as<torch::nn::BatchNorm1d>()->num_batches_tracked.fill_(9);
  tandem::run_local(1, [&](LocalComm& comm) {
    tandem::torch::DistributedDataParallel ddp(comm, saved.ptr());
    tandem::TrainingState state;
    tandem::torch::model(state, ddp);
    tandem::save_checkpoint(comm, dir / "new.safetensors", state);
  });
  // The same file as tandem wrote it before: num_batches_tracked of shape [1].
  const auto file = tandem::SafetensorsFile::map(dir / "new.safetensors");
  tandem::SafetensorsWriter old;
  for (const auto& entry : file.tensors()) {
    auto shape = entry.shape.empty() ? std::vector<std::int64_t>{1} : entry.shape;
    if (entry.dtype == tandem::st_dtype::I64) {
      old.add(entry.name, file.values<std::int64_t>(entry.name), shape);
    } else {
      old.add(entry.name, file.values<float>(entry.name), shape);
    }
  }
  for (const auto& [key, value] : file.metadata()) old.metadata(key, value);
  if (file.has_checksum()) old.checksum();
  old.write(dir / "old.safetensors");
  DOCTEST_CHECK(tandem::SafetensorsFile::map(dir / "old.safetensors")
                    .entry("body.1.num_batches_tracked")
                    .shape == std::vector<std::int64_t>{1});
  tandem::run_local(1, [&](LocalComm& comm) {
    tandem::torch::DistributedDataParallel ddp(comm, loaded.ptr());
    tandem::TrainingState state;
    tandem::torch::model(state, ddp);
    tandem::load_checkpoint(comm, dir / "old.safetensors", state);
  });
  const auto& count = loaded->body[1]->as<torch::nn::BatchNorm1d>()->num_batches_tracked;
  DOCTEST_CHECK(count.dim() == 0);
  DOCTEST_CHECK(count.item<std::int64_t>() == 9);
  if (!std::getenv("TANDEM_TORCH_STATE_DICT_DIR")) std::filesystem::remove_all(dir);
}

TEST_CASE("checkpoints: a run resumed at step 3 ends bit-identical to the uninterrupted run") {
  torch::set_num_threads(1);
  const auto dir = test_directory("resume");
  std::vector<Tiny> straight_nets, resumed_nets;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(3);
    straight_nets.emplace_back();
    torch::manual_seed(11 + r);  // another start: everything must come from the file
    resumed_nets.emplace_back();
  }
  const Steps data(5, 6);
  std::vector<std::vector<torch::Tensor>> straight(2), resumed(2);
  tandem::run_local(2, [&](LocalComm& comm) {
    const int r = comm.rank();
    {
      tandem::torch::DistributedDataParallel ddp(comm, straight_nets[r].ptr());
      tandem::optim::SGD opt(ddp.parameters(), {.lr = 0.1, .momentum = 0.9});
      tandem::TrainingState state;
      tandem::torch::model(state, ddp).optimizer(opt);
      train(ddp, opt, data, r, 0, 3);
      tandem::save_checkpoint(comm, dir / "step-3.safetensors", state);
      train(ddp, opt, data, r, 3, 5);
      straight[r] = snapshot(*straight_nets[r]);
    }
    {
      tandem::torch::DistributedDataParallel ddp(comm, resumed_nets[r].ptr());
      tandem::optim::SGD opt(ddp.parameters(), {.lr = 0.1, .momentum = 0.9});
      tandem::TrainingState state;
      tandem::torch::model(state, ddp).optimizer(opt);
      tandem::load_checkpoint(comm, dir / "step-3.safetensors", state);
      train(ddp, opt, data, r, 3, 5);
      resumed[r] = snapshot(*resumed_nets[r]);
    }
  });
  const auto keys = state_dict_keys(*straight_nets[0]);
  for (int r = 0; r < 2; ++r) {
    DOCTEST_REQUIRE(straight[r].size() == resumed[r].size());
    std::size_t i = 0;
    for (const auto& item : straight_nets[0]->named_parameters()) {
      DOCTEST_CHECK_MESSAGE(torch::equal(straight[r][i], resumed[r][i]),
                            "rank " << r << " " << item.key());
      ++i;
    }
    for (const auto& item : straight_nets[0]->named_buffers()) {
      DOCTEST_CHECK_MESSAGE(torch::equal(straight[r][i], resumed[r][i]),
                            "rank " << r << " " << item.key());
      ++i;
    }
  }
  DOCTEST_CHECK(straight_nets[0]
                    ->body[1]
                    ->as<torch::nn::BatchNorm1d>()
                    ->num_batches_tracked.item<std::int64_t>() == 5);
  std::filesystem::remove_all(dir);
}

namespace {

/// Each rank's parameters and buffers, and its optimizer state's bytes, after `steps` steps of
/// SGD with momentum on 2 LocalComm ranks wrapped with `Policies` (ZeRO: ddp.shard(opt)).
template <class... Policies>
std::pair<std::vector<std::vector<torch::Tensor>>, std::vector<std::size_t>> trained_with(
    const Steps& data, int steps) {
  std::vector<Tiny> nets;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(3);
    nets.emplace_back();
  }
  std::vector<std::vector<torch::Tensor>> weights(2);
  std::vector<std::size_t> state_bytes(2);
  tandem::run_local(2, [&](LocalComm& comm) {
    const int r = comm.rank();
    tandem::torch::DistributedDataParallel<LocalComm, Policies...> ddp(comm, nets[r].ptr());
    tandem::optim::SGD opt(ddp.parameters(), {.lr = 0.1, .momentum = 0.9});
    ddp.shard(opt);
    train(ddp, opt, data, r, 0, steps);
    weights[r] = snapshot(*nets[r]);
    state_bytes[r] = opt.state_bytes();
  });
  return {weights, state_bytes};
}

}  // namespace

TEST_CASE("ZeRO through the bridge: shard<1> and shard<2> end bit-identical to plain DDP") {
  torch::set_num_threads(1);
  const Steps data(4, 5);
  const auto [ddp_weights, ddp_state] = trained_with<>(data, 4);
  const auto [stage1_weights, stage1_state] = trained_with<tandem::shard<1>>(data, 4);
  const auto [stage2_weights, stage2_state] = trained_with<tandem::shard<2>>(data, 4);
  for (std::size_t r = 0; r < 2; ++r) {
    DOCTEST_REQUIRE(stage1_weights[r].size() == ddp_weights[r].size());
    DOCTEST_REQUIRE(stage2_weights[r].size() == ddp_weights[r].size());
    for (std::size_t i = 0; i < ddp_weights[r].size(); ++i) {
      DOCTEST_CHECK_MESSAGE(torch::equal(stage1_weights[r][i], ddp_weights[r][i]),
                            "shard<1>, rank " << r << ", tensor " << i);
      DOCTEST_CHECK_MESSAGE(torch::equal(stage2_weights[r][i], ddp_weights[r][i]),
                            "shard<2>, rank " << r << ", tensor " << i);
    }
    // Each rank keeps momentum for its half of the arena (plus at most one tail element).
    DOCTEST_CHECK(stage1_state[r] <= ddp_state[r] / 2 + sizeof(float));
    DOCTEST_CHECK(stage2_state[r] <= ddp_state[r] / 2 + sizeof(float));
  }
  DOCTEST_CHECK(stage1_state[0] + stage1_state[1] == ddp_state[0]);
}

TEST_CASE("checkpoints: a buffer of a dtype the file cannot hold is an Error naming it") {
  tandem::run_local(1, [](LocalComm& comm) {
    Net net;
    net->register_buffer("mask", torch::ones({3}, torch::kBool));
    tandem::torch::DistributedDataParallel ddp(comm, net.ptr());  // training does not mind
    tandem::TrainingState state;
    const auto e = error_of([&] { tandem::torch::model(state, ddp); });
    DOCTEST_CAPTURE(e);
    DOCTEST_CHECK(contains(e, "'mask' (Bool)"));
  });
}
#endif
