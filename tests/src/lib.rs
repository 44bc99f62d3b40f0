//! Harness of kvroute's black-box tests: a real `nats-server` per test on a free loopback
//! port, and simulated workers (real worker-core engines publishing over the real event
//! plane) whose true cache contents the tests compare the router's index against.
#![forbid(unsafe_code)]

pub mod engines;
pub mod fleet;
pub mod nats;
pub mod procs;
pub mod sim;
