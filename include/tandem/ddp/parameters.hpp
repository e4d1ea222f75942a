// tandem/ddp/parameters.hpp - DEPRECATED: forwards to tandem/arena/parameters.hpp; include that
// instead. This old path keeps working in tandem 0.1 and 0.2 and goes away in 0.3 (issue 21 moved
// Parameters to tandem/arena/). No #warning here: it would break builds with -Werror.
#pragma once

#include "tandem/arena/parameters.hpp"
