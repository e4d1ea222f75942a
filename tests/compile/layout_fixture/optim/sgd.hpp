// A header of optim/ that includes ddp/, which is not a concept header: layout_rules_catches
// expects scripts/check_layout.py to name this include.
#pragma once

#include "tandem/ddp/ddp.hpp"
