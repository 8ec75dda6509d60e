//! AECP on the mount: knowledge and contract artifacts delivered at the point of use.
//!
//! Not implemented yet: this crate holds its place in the workspace (DESIGN.md §6). Nothing
//! here is called by the filesystem today; a mount without AECP has no cost.
