#include "support/relay_process.hpp"
