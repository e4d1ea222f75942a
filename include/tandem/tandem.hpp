// tandem/tandem.hpp - everything tandem offers that needs no engine beyond the C++ standard
// library and POSIX: World, tensors and execution, the threads backend, stores (rendezvous/),
// init_process_group and agree (the ranks' configuration checked at start), metrics across ranks,
// the flat arena, DDP, optimizers and LR schedules, GradScaler, precision policies, EMA, the fused
// AdamW step and SyncBatchNorm.
//   #include <tandem/tandem.hpp>
//   tandem::run_local(4, [](tandem::LocalComm& comm) { /* comm.all_reduce(...) */ });
// Needs: Linux. Engines with libraries of their own have headers of their own:
// tandem/comm/gloo/gloo.hpp (tandem::gloo), tandem/comm/mpi/mpi.hpp (tandem::mpi),
// tandem/comm/shm/shm.hpp (tandem::shm), tandem/comm/hierarchical/hierarchical.hpp (with its two
// levels' components), tandem/cuda.hpp.
#pragma once

#include "tandem/core/config.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/units.hpp"
#include "tandem/core/world.hpp"

#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/precision.hpp"
#include "tandem/tensor/tensor.hpp"

#include "tandem/rendezvous/c10d_store.hpp"
#include "tandem/rendezvous/file_store.hpp"
#include "tandem/rendezvous/init_method.hpp"
#include "tandem/rendezvous/join.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/rendezvous/tcp_store.hpp"

#include "tandem/comm/agree.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/comm/local/options.hpp"
#include "tandem/comm/metrics.hpp"
#include "tandem/comm/work.hpp"

#include "tandem/arena/parameters.hpp"

#include "tandem/data/batches.hpp"
#include "tandem/data/dataset.hpp"
#include "tandem/data/loader.hpp"
#include "tandem/data/sampler.hpp"

#include "tandem/ddp/ddp.hpp"
#include "tandem/ddp/join.hpp"
#include "tandem/ddp/policies.hpp"

#include "tandem/amp/grad_scaler.hpp"
#include "tandem/nn/sync_batch_norm.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/optim/fused_step.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#include "tandem/optim/optimizer.hpp"
#include "tandem/optim/param_groups.hpp"
#include "tandem/optim/sgd.hpp"
