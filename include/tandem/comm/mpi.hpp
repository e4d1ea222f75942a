// tandem/comm/mpi.hpp - DEPRECATED: forwards to tandem/comm/mpi/mpi.hpp; include that instead.
// This old path keeps working in tandem 0.1 and 0.2 and goes away in 0.3 (issue 21 moved
// MpiComm to tandem/comm/mpi/). No #warning here: it would break builds with -Werror.
#pragma once

#include "tandem/comm/mpi/mpi.hpp"
