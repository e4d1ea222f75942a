// tandem/comm/gloo.hpp - DEPRECATED: forwards to tandem/comm/gloo/gloo.hpp; include that instead.
// This old path keeps working in tandem 0.1 and 0.2 and goes away in 0.3 (issue 21 moved
// GlooComm to tandem/comm/gloo/). No #warning here: it would break builds with -Werror.
#pragma once

#include "tandem/comm/gloo/gloo.hpp"
