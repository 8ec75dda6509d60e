//! AGLX: the agent protocol over TCP and UDP, and its bridge to AWCP lifecycle events.
//!
//! Not implemented yet: this crate holds its place in the workspace (DESIGN.md §7).
