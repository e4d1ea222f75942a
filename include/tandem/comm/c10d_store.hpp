// tandem/comm/c10d_store.hpp - DEPRECATED: forwards to tandem/rendezvous/c10d_store.hpp; include
// that instead. This old path keeps working in tandem 0.1 and 0.2 and goes away in 0.3 (issue 21
// moved C10dStore to tandem/rendezvous/). No #warning here: it would break builds with -Werror.
#pragma once

#include "tandem/rendezvous/c10d_store.hpp"
