// The drain gate: how a server pod's fkserve serves on after its stop signal (handoff_protocol.h,
// "Draining"). Armed from the serving thread after the mode installed its own stop handlers,
// it holds SIGTERM instead: the signal is recorded (and a pipe made readable for a poll), the
// mode's handler does not run, and serving goes on. Release() puts the mode's handler back and
// delivers the held SIGTERM to the serving thread, which then stops as it would have at once.
// SIGINT and SIGHUP are never held.
#pragma once

namespace fusekeeper {

// The serving thread, once. False if it cannot be armed (stop signals then act at once).
bool ArmDrainGate();
// A SIGTERM is held. Any thread.
bool DrainHeld();
// Readable once a SIGTERM is held (for poll); -1 when not armed.
int DrainGateFd();
// Any thread: the held (or a fresh) SIGTERM goes to the serving thread's own handler. Once.
void ReleaseDrainGate();

}  // namespace fusekeeper
