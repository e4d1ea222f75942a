// What layout_fixture/optim/sgd.hpp includes against the rule.
#pragma once
