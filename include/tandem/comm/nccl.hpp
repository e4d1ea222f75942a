// tandem/comm/nccl.hpp - DEPRECATED: forwards to tandem/comm/nccl/nccl.hpp; include that instead.
// This old path keeps working in tandem 0.1 and 0.2 and goes away in 0.3 (issue 21 moved
// NcclComm to tandem/comm/nccl/). No #warning here: it would break builds with -Werror.
#pragma once

#include "tandem/comm/nccl/nccl.hpp"
