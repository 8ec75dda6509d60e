//! AECP on the mount: knowledge artifacts delivered at the point of use (DESIGN.md §6,
//! `docs/AECP.md`).
//!
//! * [`knowledge`] — the artifact model and the fixed delivery template.
//! * [`policy`] — the one policy struct (limits, order, forwarding) and ownership globs.
//! * [`scope`] — scope resolution at publish time (tree-sitter) and the import graph.
//! * [`index`] — the path → artifacts index a mount replicates, and its stream events.
//! * [`witness`] — the witness runner (timeout, process group, network namespace).
//! * [`store`] — the SQLite store and its append-only audit log (on the Delegator).
//! * [`hook`] — the narrow interface the mount calls on each access.

pub mod hook;
pub mod index;
pub mod knowledge;
pub mod policy;
pub mod scope;
pub mod store;
pub mod witness;
