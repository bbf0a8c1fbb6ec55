// The TRELLIS_* switches of the environment: developers' and tests' settings (kernel ways,
// profiling, the emulated GPU), not deck keys. Read one way everywhere, so that a typo is said
// rather than silently taken as on or off.
#pragma once

namespace trellis {

/// -1 where `name` is unset or empty, 0 for "0", 1 for "1"; any other value is warned of on
/// stderr (once a variable and process, naming it) and taken as unset, -1.
int env_switch(const char* name);

/// env_switch as a bool: `otherwise` where it is unset (or not 0 or 1).
inline bool env_switch_on(const char* name, bool otherwise) {
  const int v = env_switch(name);
  return v < 0 ? otherwise : v == 1;
}

}  // namespace trellis
